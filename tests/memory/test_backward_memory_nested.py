"""``backward_memory()`` on a double backward through a nested-tensor op (it used to raise a raw TypeError
from the workspace measurement): truth from torch.profiler (tests/_memtruth.py)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import gradscope
from tests._memtruth import measure

warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")


class NestedGrad(nn.Module):
    """A gradient penalty through a nested tensor: the loss is built from ``autograd.grad(create_graph=True)``."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 32))

    def forward(self):
        nt = torch.nested.as_nested_tensor([self.w * 2, self.w[:5] * 3])
        y = torch.nested.to_padded_tensor(nt.sin(), 0.0).sum()
        (g,) = torch.autograd.grad(y, self.w, create_graph=True)
        return g.pow(2).sum()


def _forward():
    torch.manual_seed(0)
    model = NestedGrad()
    return model(), model


def test_double_backward_through_a_nested_tensor_op():
    loss, _ = _forward()
    gradscope.inspect(loss).backward_memory()                        # warm the workspace cache
    truth = measure(_forward, inspect=lambda loss, m: gradscope.inspect(loss, model=m),
                    predict=lambda report, _opt: report.backward_memory())
    bm = truth.prediction
    assert truth.peak > 0 and bm.peak >= truth.peak                  # never under the profiler's peak
    assert bm.peak <= 1.05 * truth.peak, (bm.peak, truth.peak)
    loss, model = _forward()
    loss.backward()                                                  # torch runs it; gradscope changed nothing
    assert model.w.grad is not None and torch.isfinite(model.w.grad).all()
