"""Graphs that exercise every branch of the walk: each builder returns ``(root, params)``.

``params`` is a name -> tensor mapping for ``inspect(root, params=...)``. Shared by tests/walk/test_compact.py.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests._render_models import lstm, planted, tied


def _named(model):
    return dict(model.named_parameters())


def _model(build):
    def make():
        root, model = build()
        return root, _named(model)
    return make


def _mlp():
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    return (m(x) * 2 / 4.0).pow(2).mean(), _named(m)


def _stale():
    w = nn.Parameter(torch.randn(4))
    y = w.sigmoid()
    z = y * y
    y.mul_(2)                                   # SigmoidBackward0's saved output is now stale
    return z.sum() + y.sum(), {"w": w}


def _hooks():
    w = nn.Parameter(torch.randn(3, 3))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = (w @ w).tanh()
    with torch.autograd.graph.save_on_cpu():
        z = y.exp()
    return z.sum(), {"w": w}


def _checkpoints():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    a = checkpoint(lambda t: lin(t).relu(), x, use_reentrant=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b = checkpoint(lambda t: lin(t).sigmoid(), a, use_reentrant=True)
    return b.sum(), _named(lin)


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        ctx.save_for_backward(x)
        return x * k

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * ctx.k + 0 * x, None


def _custom():
    w = nn.Parameter(torch.randn(5))
    return _Scale.apply(w.sin(), 3).sum(), {"w": w}


def _freed():
    w = nn.Parameter(torch.randn(6, 3))
    idx = torch.tensor([0, 2, 2])
    y = (w[idx].sin() * w.sum()).cumsum(0)
    y.sum().backward()
    return (y * 1).sum(), {"w": w}


def _multi_out():
    w = nn.Parameter(torch.randn(6, 4))
    a, b, c = w.split(2)
    parts = torch.unbind(w.t())
    return (a * b).sum() + c.exp().sum() + torch.stack(parts[:2]).max(), {"w": w}


def _nested():
    a = torch.randn(2, 3, requires_grad=True)
    nt = torch.nested.as_nested_tensor([a * 2, a[:1] * 3])
    return torch.nested.to_padded_tensor(nt.sin(), 0.0).sum(), {"a": a}


def _several_roots():
    w = nn.Parameter(torch.randn(3))
    x = w.exp()
    return [x.sum(), (x * w).mean(), x.detach().sum()], {"w": w}


GRAPHS = {
    "planted": _model(planted), "tied": _model(tied), "lstm": _model(lambda: lstm(20)),
    "mlp": _mlp, "stale": _stale, "hooks": _hooks, "checkpoints": _checkpoints, "custom": _custom,
    "freed": _freed, "multi_out": _multi_out, "nested": _nested, "several_roots": _several_roots,
}
