"""The per-rank body of the FSDP2 test of ``gradscope.watch`` (its own module: any start method finds it)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import gradscope
from tests._zoo import Linears
from tests.watch._ddp import init


class Net(Linears):
    LAYERS = {"body": (4, 4), "head": (4, 2), "unused": (4, 2)}

    def forward(self, x):
        return self.head(self.body(x).relu())


def worker(rank: int, port: int, out_dir: str) -> None:
    """A sharded model with a never-called submodule, then a NaN made on rank 0 only; writes JSON."""
    from torch.distributed.fsdp import fully_shard
    init(rank, port)
    out: dict = {}
    try:
        torch.manual_seed(0)
        model = Net()
        for sub in (model.body, model.head, model.unused):
            fully_shard(sub)
        fully_shard(model)
        seen: list = []
        with gradscope.watch(model, on_error=seen.extend) as guard:
            model(torch.randn(3, 4)).sum().backward()
            out["none"] = sorted(p for f in seen if f.kind == "none-grad" for p in f.params)
            out["none_truth"] = sorted(n for n, p in model.named_parameters() if p.grad is None)
            out["grad_types"] = sorted({type(p.grad).__name__ for p in model.parameters() if p.grad is not None})
            out["history"] = guard.history
            out["local_norms"] = {m: float(torch.linalg.vector_norm(torch.cat([
                p.grad.to_local().flatten() for p in getattr(model, m).parameters()]))) for m in ("body", "head")}
            seen.clear()
            o = model(torch.randn(3, 4))
            (o.sum() + ((o * 0).sqrt().sum() if rank == 0 else 0)).backward()     # NaN from rank 0 only
            out["nan"] = sorted(p for f in seen if f.kind == "nonfinite-grad" for p in f.params)
            out["nan_truth"] = sorted(n for n, p in model.named_parameters()
                                      if p.grad is not None and not p.grad.to_local().isfinite().all())
            out["checks"] = guard.checks
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        dist.destroy_process_group()
