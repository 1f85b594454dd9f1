"""Per-rank FSDP2 / DDP memory: gradscope and FSDPMemTracker side by side against the same real runs.

For each config, the step runs for real on gloo ranks (``torch.multiprocessing.spawn``, CPU, torch.profiler
per rank, 3 runs: ``tests/_shardtruth.py``); gradscope predicts it from one process on the unsharded model
(``report.what_if(shard=...)``); ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` predicts it
in one process under ``FakeTensorMode`` with the fake process group. Each one's error against the lowest
real run is printed, with the spread of the real runs.

Target (exit 1 when missed): gradscope's floor within 1% of the lowest real run, and every real run at or
below gradscope's ceiling, on every config (float32, and bfloat16 parameters with a float32 reduce).

    python bench/shard_bench.py            # mlp, gpt, llama at 2 ranks
    python bench/shard_bench.py mlp
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
}


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
    spec = gradscope.FSDP(world, modules=[SHARDED[model_name]], reshard_after_forward=cfg.get("reshard", True),
                          mp_policy=_mp() if cfg.get("mp") else None)
    try:
        return report.what_if(optimizer=torch.optim.AdamW(model.parameters()), shard=spec).peak_range
    except InputValueError:
        return None


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
        kw = {"mesh": mesh, "reshard_after_forward": cfg.get("reshard", True)}
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
    args = ap.parse_args()
    world, missed = 2, []
    print(f"{'model':6} {'config':18} {'real min':>10} {'real max':>10} {'gradscope low..high':>22} {'err':>7} "
          f"{'tracker':>10} {'err':>7}")
    for model_name in args.models:
        names = list(CONFIGS)
        real = measure(model_name, [CONFIGS[n] for n in names], world=world, runs=args.runs)
        for name, runs in zip(names, real):
            cfg = CONFIGS[name]
            lo_real = min(min(r) for r in runs)
            hi_real = max(max(r) for r in runs)
            rng = gradscope_range(model_name, cfg, world)
            trk = tracker_peak(model_name, cfg, world)
            t_err = (trk - lo_real) / lo_real
            if rng is None:
                g = f"{'not predicted':>22} {'':>7}"
            else:
                err = (rng[0] - lo_real) / lo_real
                g = f"{rng[0]:>10,}..{rng[1]:>10,} {err:>+7.2%}"
                if abs(err) > 0.01 or hi_real > rng[1]:
                    missed.append(f"{model_name} {name}")
            print(f"{model_name:6} {name:18} {lo_real:>10,} {hi_real:>10,} {g} {trk:>10,} {t_err:>+7.2%}")
    if missed:
        print("target missed (floor within 1% of the lowest run, every run <= ceiling):", ", ".join(missed))
        return 1
    print("target met: gradscope's floor error at most 1% everywhere (against the lowest real run), every real "
          "run <= its ceiling")
    return 0


if __name__ == "__main__":
    sys.exit(main())
