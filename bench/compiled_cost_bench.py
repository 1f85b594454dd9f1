"""What inspecting a torch.compile'd model costs against inspecting the same model eager, in the same run.

For each model of tests/_compiled_mem.py (MLP, pre-LN attention block, conv net, a tiny HF GPT-2, the MLP
with a graph break) compiled with ``aot_eager``: the thread CPU time of ``gradscope.inspect(loss, model=...)``
on the compiled model as a ratio to the same call on the eager model, and the same ratio for ``inspect``
followed by ``backward_memory()``. Each sample is ten fresh forwards (not timed) and the timed calls on them; the
eager and compiled samples are interleaved, the median of ``--rounds`` is kept (a training loop inspects a
new graph every step, so what torch or gradscope keeps per compiled region is reused, as it would be).

Target (exit status 1 when missed): compiled/eager <= 1.0x for ``inspect`` on every model. The
``backward_memory`` ratio is printed for information (a region's replay reads its whole backward graph).

    python bench/compiled_cost_bench.py                  # every model
    python bench/compiled_cost_bench.py mlp --rounds 21  # some models, more rounds
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import gradscope
from tests._compiled_mem import build

TARGET = 1.0
NAMES = ["mlp", "attn", "conv", "gpt2", "break"]


def _sample(model, inputs, loss, memory: bool, graphs: int = 10) -> float:
    outs = [loss(model, *inputs) for _ in range(graphs)]  # fresh graphs, made before the clock starts
    t0 = time.thread_time()
    for out in outs:
        r = gradscope.inspect(out, model=model)
        if memory:
            r.backward_memory()
    return (time.thread_time() - t0) / graphs


def _ratios(name: str, rounds: int) -> tuple[float, float, float]:
    model, cm, inputs, loss = build(name, "aot_eager")
    for m in (model, cm):  # warm up: the compile, the workspace cache, imports
        for memory in (False, True):
            _sample(m, inputs, loss, memory)
    got: dict = {(m, k): [] for m in ("eager", "compiled") for k in (False, True)}
    for _ in range(rounds):
        for memory in (False, True):
            got[("eager", memory)].append(_sample(model, inputs, loss, memory))
            got[("compiled", memory)].append(_sample(cm, inputs, loss, memory))
    med = {k: statistics.median(v) for k, v in got.items()}
    return (med[("eager", False)], med[("compiled", False)] / med[("eager", False)],
            med[("compiled", True)] / med[("eager", True)])


def main(argv: list[str]) -> int:
    rounds = 11
    if "--rounds" in argv:
        i = argv.index("--rounds")
        rounds = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2 :]
    torch.set_num_threads(1)
    missed = 0
    print(f"{'model':8} {'eager inspect':>14} {'compiled/eager inspect':>23} {'+ backward_memory':>18}  verdict")
    for name in argv or NAMES:
        eager, ratio, with_memory = _ratios(name, rounds)
        ok = ratio <= TARGET
        missed += not ok
        print(f"{name:8} {1000 * eager:11.2f} ms {ratio:22.2f}x {with_memory:17.2f}x  "
              f"{'ok' if ok else 'MISS'} (target <= {TARGET:.1f}x)", flush=True)
    print(f"{missed} missed target(s)")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
