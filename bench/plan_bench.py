"""Plans applied for real: per model, the budget, the plan, predicted vs measured peak, recompute, planning time.

For each model the unchanged step's peak is predicted, a budget is set below it (``--frac`` of it), and
``report.plan(budget=...)`` is asked for a plan. The plan's printed code is executed on a fresh copy of the
model and one training step (forward, backward) runs under torch.profiler (tests/_steptruth.py); with
``--adamw``, three steps of the loop (forward, backward, ``AdamW.step()``, ``zero_grad()``), the highest
of them: AdamW's state, created in step 1, is alive from step 2 on, and the prediction is for that step
too. The forward is also timed with and without the plan (median of 5).

Targets (exit 1 when one is missed): every plan that says it fits measures within the budget; every
prediction (unchanged step and planned step) is within 2% of the measured peak; planning costs at most
150 replays of the step (``report.backward_memory()``, timed in the same run).

    python bench/plan_bench.py               # all models
    python bench/plan_bench.py gpt12 --frac 0.6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gradscope  # noqa: E402
from gradscope._format import human_bytes  # noqa: E402
from gradscope.memory.planning.plan import span_names  # noqa: E402
from tests import _plan_models as pm  # noqa: E402
from tests._steptruth import measure_step, measure_steps  # noqa: E402

TOL, PLAN_REPLAYS = 0.02, 150


def gpt12(batch=16, device="cpu"):
    """The worked example of docs/planning.md: a 12-block GPT (d=128, context 128), batch 16 here."""
    return pm.gpt(batch, n_layer=12, d=128, heads=4, vocab=512, ctx=128, device=device)


MODELS = {"gpt_tiny": pm.gpt_tiny, "gpt": pm.gpt, "gpt_wide": pm.gpt_wide, "gpt12": gpt12,
          "encoder": pm.encoder, "resnet": pm.resnet, "shared_mlp": pm.shared_mlp, "lstm": pm.lstm}


def _step(build, state, adamw, code=None):
    torch.manual_seed(0)
    model, inputs, loss_fn = build()
    model.load_state_dict(state)
    if code:
        exec(code, {"model": model})
    if not adamw:
        return model, inputs, loss_fn, measure_step(model, inputs, loss_fn, None)["peak"]
    # three steps of the loop: AdamW's state, created in step 1, is alive from step 2 on; the highest step
    opt = torch.optim.AdamW(model.parameters())
    steps = measure_steps(model, lambda s, k: inputs, loss_fn, opt, steps=3, before=inputs)["steps"]
    return model, inputs, loss_fn, max(steps)


def _forward_time(model, inputs, loss_fn, repeat=5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        loss_fn(model, *inputs).backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def run(name, build, frac, adamw) -> list[str]:
    torch.manual_seed(0)
    model, inputs, loss_fn = build()
    opt = torch.optim.AdamW(model.parameters()) if adamw else None
    with gradscope.trace(model) as tr:
        loss = loss_fn(model, *inputs)
    report = gradscope.inspect(loss, model=model, trace=tr)
    t = time.perf_counter()
    report.backward_memory(optimizer=opt)
    one_replay = time.perf_counter() - t
    before = report.what_if(optimizer=opt).peak
    budget = int(before * frac)
    plan = report.plan(budget=budget, optimizer=opt)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    del loss, report, tr, model
    m0, i0, f0, measured_before = _step(build, state, adamw)
    m1, i1, f1, measured = _step(build, state, adamw, plan.code)
    t0, t1 = _forward_time(m0, i0, f0), _forward_time(m1, i1, f1)
    misses = []
    if abs(before - measured_before) > TOL * measured_before:
        misses.append(f"{name}: unchanged step predicted {before}, measured {measured_before}")
    if plan.fits and measured > budget:
        misses.append(f"{name}: the plan measured {measured} > budget {budget}")
    if plan.checkpoint and abs(plan.peak - measured) > TOL * measured:
        misses.append(f"{name}: planned step predicted {plan.peak}, measured {measured}")
    if plan.seconds > PLAN_REPLAYS * one_replay:
        misses.append(f"{name}: planning took {plan.seconds:.2f} s = {plan.seconds / one_replay:.0f} replays "
                      f"> {PLAN_REPLAYS}")
    ok = "fits" if plan.fits else "NO PLAN"
    print(f"{name:11s} {human_bytes(budget):>10s} {human_bytes(before):>10s} {human_bytes(measured_before):>10s} "
          f"{human_bytes(plan.peak):>10s} {human_bytes(measured):>10s} {ok:8s} "
          f"+{plan.recompute_share:4.0%} {t1 / t0 - 1:+6.0%} {plan.seconds * 1000:7.0f} ms "
          f"{plan.seconds / one_replay:4.0f}x  "
          f"{span_names(plan.checkpoint) or '-'}", flush=True)
    return misses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(MODELS))
    ap.add_argument("--frac", type=float, default=0.75, help="budget as a share of the unchanged peak")
    ap.add_argument("--adamw", action="store_true", help="the step includes AdamW's optimizer.step()")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{'model':11s} {'budget':>10s} {'pred now':>10s} {'meas now':>10s} {'pred plan':>10s} "
          f"{'meas plan':>10s} {'':8s} {'FLOPs':>5s} {'f+b time':>6s} {'planning':>10s} {'/replay':>5s}  checkpoint")
    misses = []
    for name in args.models:
        misses += run(name, MODELS[name], args.frac, args.adamw)
    for m in misses:
        print("MISSED:", m)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
