"""A small randomized grid of healthy loops: several backwards per step, dtypes, optimizers. Each runs
unwatched and under ``watch(on_error="raise")`` from the same seed (``tests/watch/_twins.py``): nothing may
be raised and the gradients and weights must be bit-identical; truth of "healthy" from torch: at every
``opt.step()`` each parameter the optimizer holds has a finite, non-None ``.grad``."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from tests.watch._twins import twin


class Heads(nn.Module):
    def __init__(self, heads):
        super().__init__()
        self.trunk = nn.Linear(4, 8)
        self.heads = nn.ModuleList(nn.Linear(8, 1) for _ in range(heads))

    def forward(self, x, head=None):
        h = torch.tanh(self.trunk(x))
        return [m(h) for m in self.heads] if head is None else self.heads[head](h)


def _config(seed):
    r = random.Random(seed)
    return {
        "heads": r.randint(1, 3),
        "pattern": r.choice(["one-loss", "retain", "micro-batches"]),
        "dtype": r.choice([torch.float32, torch.float64, torch.bfloat16]),
        "optimizer": r.choice(["SGD", "Adam", "AdamW"]),
        "steps": r.randint(2, 4),
        "zero": r.choice([True, False]),  # zero_grad(set_to_none=...)
    }


@pytest.mark.parametrize("seed", range(12))
def test_random_healthy_loop(seed):
    c = _config(seed)

    def build():
        model = Heads(c["heads"]).to(c["dtype"])
        return model, getattr(torch.optim, c["optimizer"])(model.parameters(), lr=1e-2)

    def step(model, opt, i):
        opt.zero_grad(set_to_none=c["zero"])
        x = torch.randn(3, 4, dtype=c["dtype"])
        if c["pattern"] == "one-loss":
            sum(y.float().pow(2).mean() for y in model(x)).backward()
        elif c["pattern"] == "retain":                    # one backward per head, from one forward
            ys = model(x)
            for k, y in enumerate(ys):
                y.float().pow(2).mean().backward(retain_graph=k < len(ys) - 1)
        else:                                             # one micro-batch per head
            for k in range(c["heads"]):
                model(torch.randn(3, 4, dtype=c["dtype"]), head=k).float().pow(2).mean().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())   # healthy
        opt.step()

    guard = twin(build, step, steps=c["steps"])
    assert guard.counts == {}, c
