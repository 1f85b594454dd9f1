"""Small models with planted bugs for the rendering tests (and their golden DOT files)."""

from __future__ import annotations

import torch
from torch import nn


class Planted(nn.Module):
    """Linear -> sigmoid -> Linear, with an in-place write on a saved activation and an unused layer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 1)
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        h = torch.sigmoid(self.a(x))
        out = self.b(h)
        h.mul_(2)                      # SigmoidBackward0 saved h: backward() will raise
        return out.sum()


def planted():
    torch.manual_seed(0)
    model = Planted()
    return model(torch.randn(2, 3)), model


class Tied(nn.Module):
    """An embedding whose weight is reused by the output layer (a shared parameter), inside a block."""

    def __init__(self, vocab: int = 7, d: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))

    def forward(self, idx):
        h = self.block(self.emb(idx))
        return (h @ self.emb.weight.t()).logsumexp(-1).mean()


def tied():
    torch.manual_seed(0)
    model = Tied()
    return model(torch.tensor([[1, 2, 3]])), model


class LSTMish(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(3, 5)
        self.head = nn.Linear(5, 1)


def lstm(steps: int = 200):
    torch.manual_seed(0)
    model = LSTMish()
    h = c = torch.zeros(1, 5)
    xs = torch.randn(steps, 1, 3)
    for t in range(steps):
        h, c = model.cell(xs[t], (h, c))
    return model.head(h).sum(), model
