"""backward_memory() of torch.compile'd models against torch.profiler: the error per model and backend.

For each model of tests/_compiled_mem.py (MLP, pre-LN attention block, conv net, a tiny HF GPT-2, the MLP
with a graph break, the attention block with ``dynamic=True``) and each backend: with ``.grad`` empty and
set, the predicted backward peak and the step's absolute peak (AdamW) against one profiled step on CPU
(tests/_memtruth.measure); then three real training steps with SGD (momentum): the first step's and the
later steps' absolute peaks (``bm.first_step`` / ``bm.later_step``, tests/_steptruth.measure_steps).
Targets: ``aot_eager`` within 1%; ``inductor`` within 5% unless the answer is labelled a bound; nothing
more than 1% low without the lower-bound label. Exits non-zero when a target is missed.

    python bench/compiled_memory_bench.py                       # every model, both backends
    python bench/compiled_memory_bench.py --backend aot_eager   # one backend
    python bench/compiled_memory_bench.py mlp attn              # some models
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gradscope.memory.kernels.regions import UPPER
from tests._compiled_mem import run_case, run_steps

_TOL = {"aot_eager": 0.01, "inductor": 0.05}
NAMES = ["mlp", "attn", "conv", "gpt2", "break", "attn-dyn"]


def _verdict(backend: str, errs: list, bound: str | None) -> str:
    if bound == "lower":
        return "ok (lower bound)" if max(errs) <= 0.01 else "MISS (lower bound above truth)"
    if bound == "upper":
        return "ok (upper bound)" if min(errs) >= -0.01 else "MISS (upper bound below truth)"
    if min(errs) < -0.01:
        return "MISS (low, unlabelled)"
    return "ok" if max(map(abs, errs)) <= _TOL[backend] else "MISS"


def _bound(bm) -> str | None:
    return "lower" if bm.unmodelled else ("upper" if any(UPPER in n for n in bm.notes) else None)


def _err(pred: int, truth: int) -> float:
    return (pred - truth) / truth


def main(argv: list[str]) -> int:
    backends = list(_TOL)
    if "--backend" in argv:
        i = argv.index("--backend")
        backends = [argv[i + 1]]
        argv = argv[:i] + argv[i + 2 :]
    names = argv or NAMES
    missed = 0
    print(f"{'backend':10} {'model':9} {'case':12} {'pred':>9} {'measured':>9} {'err':>8}  "
          f"{'pred':>9} {'measured':>9} {'err':>8}  verdict")
    for backend in backends:
        for name in names:
            for grad_set in (False, True):  # the backward peak, then the step's absolute peak (AdamW)
                truth, bm = run_case(name, backend, grad_set)
                step_pred = bm.first_step.absolute_peak
                errs = [_err(bm.peak, truth.peak), _err(step_pred, truth.absolute_peak)]
                verdict = _verdict(backend, errs, _bound(bm))
                missed += verdict.startswith("MISS")
                case = "grad set" if grad_set else "grad empty"
                print(f"{backend:10} {name:9} {case:12} {bm.peak:9d} {truth.peak:9d} {100 * errs[0]:+7.2f}%  "
                      f"{step_pred:9d} {truth.absolute_peak:9d} {100 * errs[1]:+7.2f}%  {verdict}", flush=True)
            steps, bm = run_steps(name, backend, "sgd")  # the first step, then the later ones
            first, later = bm.first_step.absolute_peak, bm.later_step.absolute_peak
            errs = [_err(first, steps[0]), _err(later, max(steps[1:]))]
            verdict = _verdict(backend, errs, _bound(bm))
            missed += verdict.startswith("MISS")
            print(f"{backend:10} {name:9} {'steps (SGD)':12} {first:9d} {steps[0]:9d} {100 * errs[0]:+7.2f}%  "
                  f"{later:9d} {max(steps[1:]):9d} {100 * errs[1]:+7.2f}%  {verdict}", flush=True)
    print("columns: backward peak, step's absolute peak (AdamW); for 'steps': first step, later steps (bytes)")
    print(f"{missed} missed target(s)")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
