"""Compiled models and their memory truth, shared by tests/memory/test_compiled_memory.py and
bench/compiled_memory_bench.py.

Each case compiles a fresh model (``torch._dynamo.reset()`` first), runs one warm-up step when
``grad_set`` (so ``.grad`` is set and the backward graph compiled), then measures one step with
tests/_memtruth.measure (torch.profiler's memory events on CPU): the backward peak and the absolute step
peak (AdamW), with ``report.backward_memory(optimizer=...)`` predicted inside the profiled run, before
backward.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import gradscope
from tests._memtruth import measure

__all__ = ["MODELS", "run_case"]


class MLP(nn.Module):
    def __init__(self, d=64, h=128, out=10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, out))

    def forward(self, x):
        return self.net(x)


class PreLNBlock(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        y = self.ln1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ConvNet(nn.Module):
    def __init__(self, c=8, classes=10):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1, stride=2), nn.BatchNorm2d(2 * c), nn.ReLU(),
        )
        self.head = nn.Linear(2 * c, classes)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


#: name -> (model factory, input factory), at the sizes the issue measured (the MLP at batch 256) and tiny ones
MODELS = {
    "mlp": (MLP, lambda: torch.randn(256, 64)),
    "mlp-tiny": (lambda: MLP(16, 32, 4), lambda: torch.randn(8, 16)),
    "attn": (PreLNBlock, lambda: torch.randn(4, 16, 32)),
    "attn-tiny": (lambda: PreLNBlock(16, 2), lambda: torch.randn(2, 8, 16)),
    "conv": (ConvNet, lambda: torch.randn(4, 3, 16, 16)),
    "conv-tiny": (lambda: ConvNet(4), lambda: torch.randn(2, 3, 8, 8)),
}


def run_case(name: str, backend: str, grad_set: bool, optimizer: bool = True):
    """``(truth, prediction)`` for one compiled model: truth from tests/_memtruth.measure, the prediction
    ``report.backward_memory(optimizer=opt, inputs=[x])`` (the batch the caller holds) made inside the
    profiled run, before backward."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    make, data = MODELS[name]
    model = make()
    x = data()
    cm = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters()) if optimizer else None
    if grad_set:
        cm(x).sum().backward()
    # warm the in-node workspace cache (it does not measure while a profiler runs)
    gradscope.inspect(cm(x).sum(), model=cm).backward_memory(optimizer=opt, inputs=[x])
    truth = measure(
        lambda: (cm(x).sum(), cm),
        before=[x],
        optimizer=opt,
        inspect=lambda loss, m: gradscope.inspect(loss, model=m),
        predict=lambda r, o: r.backward_memory(optimizer=o, inputs=[x]),
    )
    return truth, truth.prediction
