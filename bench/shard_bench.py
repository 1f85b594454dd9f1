"""Per-rank FSDP2 / DDP memory: gradscope and FSDPMemTracker side by side against the same real runs.

For each config, a job of three steps (AdamW, ``zero_grad(set_to_none=True)`` between) runs for real on gloo
ranks (``torch.multiprocessing.spawn``, CPU, torch.profiler per rank, 3 runs: ``tests/_shardtruth.py``, its
NOTE [lost frees] applied; the spread of the trace as it is, without it, is printed too); gradscope predicts
it from one process on the unsharded model (``report.what_if(shard=...)``: the steady state, the higher of
step 1 and the later steps); ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` predicts step 1
in one process under ``FakeTensorMode`` with the fake process group (its error is against the lowest real
step 1). gradscope's error is against the lowest real later step (steps 2 and 3 of every run and rank, each
a sample: the floor of the steady state is a step that happens; a late release of gloo's lifts a random step
of a run, and the job's highest step is the likeliest lifted).

"job max*" is the highest step's lower bound (a free the trace lost whose address is not handed out again
before the peak cannot be placed: the run is then between its lower bound and the corrected level); "raw
max" the highest step of the trace as it is.

Target (exit 1 when missed): gradscope's floor within 1% of the lowest real later step, and every real run's
every step at or below gradscope's ceiling, on every config (float32, and bfloat16 parameters with a float32
reduce; resharding after forward or not; with a checkpoint per block).

    python bench/shard_bench.py                    # mlp, gpt, llama at 2 ranks
    python bench/shard_bench.py mlp --world 4      # 4 ranks (reshard: to 2 ranks after forward)
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gradscope  # noqa: E402
from gradscope.errors import InputValueError  # noqa: E402
from tests._shardmodels import SHARDED, batch, build, loss_of  # noqa: E402
from tests._shardtruth import measure  # noqa: E402

CONFIGS = {
    "fp32 reshard": {"kind": "fsdp"},
    "fp32 keep": {"kind": "fsdp", "reshard": False},
    "bf16/fp32 reshard": {"kind": "fsdp", "mp": True},
    "bf16/fp32 keep": {"kind": "fsdp", "mp": True, "reshard": False},
    "fp32 reshard ckpt": {"kind": "fsdp", "ckpt": True},
    "bf16/fp32 reshard ckpt": {"kind": "fsdp", "mp": True, "ckpt": True},
}
STEPS = 3


def _mp():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def gradscope_range(model_name: str, cfg: dict, world: int):
    torch.set_num_threads(1)  # as each rank runs: a kernel's in-node memory depends on its thread count
    model = build(model_name)
    x = batch(model_name, 8)
    with gradscope.trace(model) as tr:
        loss = loss_of(model(x))
    report = gradscope.inspect(loss, model=model, trace=tr)
    spec = gradscope.FSDP(world, modules=[SHARDED[model_name]], reshard_after_forward=_reshard(cfg, world),
                          mp_policy=_mp() if cfg.get("mp") else None)
    ck = SHARDED[model_name] if cfg.get("ckpt") else None
    try:
        return report.what_if(optimizer=torch.optim.AdamW(model.parameters()), shard=spec, checkpoint=ck)
    except InputValueError:
        return None


def _reshard(cfg: dict, world: int):
    """The config's ``reshard_after_forward``: at 4 ranks, resharding goes to 2 (an int), as in the slow grid."""
    if not cfg.get("reshard", True):
        return False
    return 2 if world == 4 else True


def tracker_peak(model_name: str, cfg: dict, world: int) -> int:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (world,))  # before FakeTensorMode: inside it, mesh creation raises
        kw = {"mesh": mesh, "reshard_after_forward": _reshard(cfg, world)}
        if cfg.get("mp"):
            kw["mp_policy"] = _mp()
        with FakeTensorMode():
            model = build(model_name)
            pat = SHARDED[model_name]
            for name, m in reversed(list(model.named_modules())):
                if fnmatch.fnmatchcase(name, pat) and name.count(".") == pat.count("."):
                    fully_shard(m, **kw)
            kw.pop("reshard_after_forward")
            fully_shard(model, **kw)
            opt = torch.optim.AdamW(model.parameters())
            x = batch(model_name, 8)
            fmt = FSDPMemTracker(model, opt)
            fmt.track_inputs((x,))
            with fmt:
                loss_of(model(x)).backward()
                opt.step()
            return int(fmt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", default=["mlp", "gpt", "llama"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    world, missed = args.world, []
    print(f"{'model':6} {'config':23} {'step 1 min':>10} {'later min':>10} {'job max*':>10} {'raw max':>10} "
          f"{'gradscope low..high':>22} {'err':>7} {'tracker':>10} {'err':>7}")
    for model_name in args.models:
        names = list(CONFIGS)
        cfgs = [{**CONFIGS[n], "steps": STEPS, "reshard": _reshard(CONFIGS[n], world)} for n in names]
        real = measure(model_name, cfgs, world=world, runs=args.runs, key="all")
        for name, runs in zip(names, real):
            cfg = CONFIGS[name]
            steps = [s for run in runs for r in run for s in [r["steps"]]]
            lo_first = min(s[0] for s in steps)
            lo_real = min(min(s[1:]) for s in steps)
            # above the ceiling only when the lower bound is (NOTE [lost frees]: a lost free not yet placed)
            hi_real = max(max(r["low_steps"]) for run in runs for r in run)
            raw = max(max(r["raw_steps"]) for run in runs for r in run)
            wi = gradscope_range(model_name, cfg, world)
            try:  # FSDPMemTracker under FakeTensorMode refuses some settings (4 ranks resharding to 2)
                trk = tracker_peak(model_name, cfg, world) if not cfg.get("ckpt") else None
            except (AssertionError, RuntimeError):
                trk = None
            t = f"{trk:>10,} {(trk - lo_first) / lo_first:>+7.2%}" if trk else f"{'':>10} {'':>7}"
            if wi is None:
                g = f"{'not predicted':>22} {'':>7}"
            else:
                rng = wi.peak_range
                err = (rng[0] - lo_real) / lo_real
                g = f"{rng[0]:>10,}..{rng[1]:>10,} {err:>+7.2%}"
                if abs(err) > 0.01 or hi_real > rng[1]:
                    missed.append(f"{model_name} {name}")
            print(f"{model_name:6} {name:23} {lo_first:>10,} {lo_real:>10,} {hi_real:>10,} {raw:>10,} {g} {t}")
    if missed:
        print("target missed (floor within 1% of the lowest later step, every step of every run <= ceiling):",
              ", ".join(missed))
        return 1
    print(f"target met at {world} ranks: gradscope's floor within 1% of the lowest real later step everywhere, every "
          "step of every run <= its ceiling")
    return 0


if __name__ == "__main__":
    sys.exit(main())
