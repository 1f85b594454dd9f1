"""A parameter used inside a reentrant checkpoint body under ``no_grad`` + ``enable_grad``: torch gives it a
gradient, so ``trace()`` must not turn the untraced warning into an error."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradscope


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def body(self, x):
        with torch.no_grad(), torch.enable_grad():
            return self.a(x)

    def forward(self, x):
        return self.b(checkpoint(self.body, x, use_reentrant=True))


def test_enable_grad_in_region():
    torch.manual_seed(0)
    model, x = Body(), torch.randn(2, 4, requires_grad=True)
    untraced = gradscope.inspect(model(x).sum(), model=model).findings
    with gradscope.trace() as tr:
        loss = model(x).sum()
    traced = gradscope.inspect(loss, model=model, trace=tr).findings
    loss.backward()
    assert model.a.weight.grad is not None                           # torch: a does get a gradient
    assert [(f.kind, f.severity) for f in untraced] == [("unused-parameter", "warning")]
    assert [(f.kind, f.severity, f.params) for f in traced] == [("unused-parameter", "warning", ("a.weight", "a.bias"))]
