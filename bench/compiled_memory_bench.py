"""backward_memory() of torch.compile'd models against torch.profiler: the error per model and backend.

For each model of tests/_compiled_mem.py (MLP, pre-LN attention block, conv net) and each backend, with
``.grad`` empty and set: the predicted backward peak and the first step's absolute peak (AdamW) against
one profiled step on CPU (tests/_memtruth.measure). Targets: ``aot_eager`` within 1%; ``inductor`` within
5% unless the answer is labelled a bound; nothing more than 1% low without the lower-bound label. Exits
non-zero when a target is missed.

    python bench/compiled_memory_bench.py                       # every model, both backends
    python bench/compiled_memory_bench.py --backend aot_eager   # one backend
    python bench/compiled_memory_bench.py mlp attn              # some models
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gradscope.memory.kernels.regions import UPPER
from tests._compiled_mem import run_case

_TOL = {"aot_eager": 0.01, "inductor": 0.05}


def _verdict(backend: str, err: float, step: float, bound: str | None) -> str:
    worst = max(abs(err), abs(step))
    if bound == "lower":
        return "ok (lower bound)" if max(err, step) <= 0.01 else "MISS (lower bound above truth)"
    if bound == "upper":
        return "ok (upper bound)" if min(err, step) >= -0.01 else "MISS (upper bound below truth)"
    if min(err, step) < -0.01:
        return "MISS (low, unlabelled)"
    return "ok" if worst <= _TOL[backend] else "MISS"


def main(argv: list[str]) -> int:
    backends = list(_TOL)
    if "--backend" in argv:
        i = argv.index("--backend")
        backends = [argv[i + 1]]
        argv = argv[:i] + argv[i + 2 :]
    names = argv or ["mlp", "attn", "conv"]
    missed = 0
    print(f"{'backend':10} {'model':6} {'.grad':6} {'peak pred':>10} {'measured':>10} {'err':>8}  "
          f"{'step pred':>10} {'measured':>10} {'err':>8}  verdict")
    for backend in backends:
        for name in names:
            for grad_set in (False, True):
                truth, bm = run_case(name, backend, grad_set)
                step_pred = bm.first_step.absolute_peak
                err = (bm.peak - truth.peak) / truth.peak
                step = (step_pred - truth.absolute_peak) / truth.absolute_peak
                bound = "lower" if bm.unmodelled else ("upper" if any(UPPER in n for n in bm.notes) else None)
                verdict = _verdict(backend, err, step, bound)
                missed += verdict.startswith("MISS")
                print(f"{backend:10} {name:6} {'set' if grad_set else 'empty':6} {bm.peak:10d} {truth.peak:10d} "
                      f"{100 * err:+7.2f}%  {step_pred:10d} {truth.absolute_peak:10d} {100 * step:+7.2f}%  {verdict}",
                      flush=True)
    print(f"{missed} missed target(s)")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
