"""The per-rank body of the DDP test of ``gradscope.watch`` (its own module: any start method finds it)."""

from __future__ import annotations

import datetime
import json
import os
import socket

import torch
import torch.distributed as dist
from torch import nn

import gradscope


class Net(nn.Module):
    def __init__(self, use_head: bool):
        super().__init__()
        self.use_head = use_head
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.body(x).relu()
        return self.head(h) if self.use_head else h


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, port: int) -> None:
    """Join the two-process gloo group on 127.0.0.1, one torch thread per process."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)


def worker(rank: int, port: int, out_dir: str) -> None:
    """Healthy DDP steps, then a model whose head is never used; writes what happened to JSON."""
    init(rank, port)
    out: dict = {}
    try:
        torch.manual_seed(0)
        healthy = nn.parallel.DistributedDataParallel(Net(use_head=True))
        with gradscope.watch(healthy) as guard:
            for _ in range(3):                  # plain SGD by hand: torch.optim's first step imports dynamo
                healthy.zero_grad()
                healthy(torch.randn(3, 4)).pow(2).mean().backward()
                with torch.no_grad():
                    for p in healthy.parameters():
                        p -= 0.1 * p.grad
            out["healthy_checks"] = guard.checks
        out["healthy_none"] = sorted(n for n, p in healthy.module.named_parameters() if p.grad is None)

        nan = nn.parallel.DistributedDataParallel(Net(use_head=True))
        with gradscope.watch(nan):
            loss = nan(torch.randn(3, 4)).sum()
            if rank == 0:                       # a NaN gradient on rank 0 only; DDP averages it to rank 1
                loss = loss + nan.module.body.weight.mul(0).sqrt().sum()
            try:
                loss.backward()
                out["nan"] = "no error"
            except gradscope.GradientError as exc:
                out["nan"] = sorted(p for f in exc.findings if f.kind == "nonfinite-grad" for p in f.params)
        out["nan_truth"] = sorted(n for n, p in nan.module.named_parameters() if not p.grad.isfinite().all())

        broken = nn.parallel.DistributedDataParallel(Net(use_head=False))   # find_unused_parameters=False
        guard = gradscope.watch(broken)
        try:
            broken(torch.randn(3, 4)).pow(2).mean().backward()
            out["step0"] = "no error"
        except gradscope.GradientError as exc:
            out["step0"] = {"type": type(exc).__name__, "message": str(exc),
                            "params": sorted(p for f in exc.findings for p in f.params),
                            "kinds": sorted({f.kind for f in exc.findings})}
        out["none_after_step0"] = sorted(n for n, p in broken.module.named_parameters() if p.grad is None)
        guard.remove()
        try:                                    # ground truth: DDP's own error only comes at step 1
            broken(torch.randn(3, 4)).pow(2).mean().backward()
            out["step1"] = "no error"
        except RuntimeError as exc:
            out["step1"] = str(exc)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        dist.destroy_process_group()
