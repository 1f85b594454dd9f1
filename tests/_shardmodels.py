"""Models and configurations shared by the sharding truth runs (``_shardtruth.py``) and the predictions."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class MLPStack(nn.Module):
    """``blocks.0`` .. ``blocks.{n-1}`` residual MLP blocks and a ``head``."""

    def __init__(self, d: int = 64, hidden: int = 256, n: int = 4, out: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(n))
        self.head = nn.Linear(d, out)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build(name: str, **kw) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return MLPStack(**kw)
    raise ValueError(name)


def batch(name: str, n: int, seed: int = 1, **kw):
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return torch.randn(n, kw.get("d", 64), generator=g)
    raise ValueError(name)


def loss_of(out):
    return out.float().pow(2).mean()
