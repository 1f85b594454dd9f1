"""Regenerate docs/example.svg, the picture in the README: a small model with two planted bugs.

    .venv/bin/python docs/make_example.py

tests/views/test_example.py regenerates it and fails when the committed file differs. No legend on it (the
legend is in docs/pictures.md): a README column is about 830 px wide and the picture stays readable there.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import gradscope


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.aux = nn.Linear(16, 4)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = self.encoder(x)
        g = torch.sigmoid(h)
        aux = self.aux(h).detach()          # bug 1: aux never gets a gradient
        out = self.head(g) + aux.mean()
        g.mul_(2)                           # bug 2: sigmoid's saved output modified in place
        return out.pow(2).mean()


def main(out: str | None = None) -> str:
    torch.manual_seed(0)
    model = Net()
    with gradscope.trace() as tr:
        loss = model(torch.randn(32, 8))
    report = gradscope.inspect(loss, model=model, trace=tr)
    out = out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "example.svg")
    return report.render(out)


if __name__ == "__main__":
    print(main())
