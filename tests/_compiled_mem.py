"""Compiled models and their memory truth, shared by tests/memory/test_compiled_memory.py and
bench/compiled_memory_bench.py.

Each case compiles a fresh model (``torch._dynamo.reset()`` first). :func:`run_case` runs one warm-up
backward when ``grad_set`` (so ``.grad`` is set and the backward graph compiled), then measures one step
with tests/_memtruth.measure (torch.profiler's memory events on CPU): the backward peak and the absolute
step peak (AdamW or SGD with momentum), with ``report.backward_memory(optimizer=...)`` predicted inside the
profiled run, before backward. :func:`run_steps` measures three real optimizer steps of a training loop
(tests/_steptruth.measure_steps): the first step's and the later steps' absolute peaks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn as nn

import gradscope
from tests._memtruth import measure
from tests._steptruth import measure_steps

__all__ = ["MODELS", "OPTIMIZERS", "Case", "build", "run_case", "run_steps"]


class MLP(nn.Module):
    def __init__(self, d=64, h=128, out=10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, out))

    def forward(self, x):
        return self.net(x)


class BreakMLP(MLP):
    """The MLP with a graph break after its first layer: two compiled regions."""

    def forward(self, x):
        h = self.net[1](self.net[0](x))
        torch._dynamo.graph_break()
        return self.net[4](self.net[3](self.net[2](h)))


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


def _sum(model, *inputs):
    return model(*inputs).sum()


class Case(NamedTuple):
    make: Callable[[], nn.Module]
    data: Callable[[], tuple]
    loss: Callable[..., torch.Tensor] = _sum
    compile: dict = {}


def _gpt2():
    import transformers

    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).train()


def _lm(model, tok):
    return model(input_ids=tok, labels=tok).loss


#: name -> Case, at the sizes the issue measured (the MLP at batch 256) and tiny ones (the default test profile)
MODELS: dict[str, Case] = {
    "mlp": Case(MLP, lambda: (torch.randn(256, 64),)),
    "mlp-tiny": Case(lambda: MLP(16, 32, 4), lambda: (torch.randn(8, 16),)),
    "attn": Case(PreLNBlock, lambda: (torch.randn(4, 16, 32),)),
    "attn-tiny": Case(lambda: PreLNBlock(16, 2), lambda: (torch.randn(2, 8, 16),)),
    "conv": Case(ConvNet, lambda: (torch.randn(4, 3, 16, 16),)),
    "conv-tiny": Case(lambda: ConvNet(4), lambda: (torch.randn(2, 3, 8, 8),)),
    "gpt2": Case(_gpt2, lambda: (torch.randint(0, 64, (2, 12)),), _lm),
    "break": Case(BreakMLP, lambda: (torch.randn(64, 64),)),
    "break-tiny": Case(lambda: BreakMLP(16, 32, 4), lambda: (torch.randn(8, 16),)),
    "attn-dyn": Case(PreLNBlock, lambda: (torch.randn(4, 16, 32),), compile={"dynamic": True}),
    "mlp-dyn-tiny": Case(lambda: MLP(16, 32, 4), lambda: (torch.randn(8, 16),), compile={"dynamic": True}),
}

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters()),
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
}


def build(name: str, backend: str):
    """``(model, compiled model, inputs, loss(model, *inputs))`` for one case, dynamo reset and seeded first."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    case = MODELS[name]
    model = case.make()
    inputs = case.data()
    return model, torch.compile(model, backend=backend, **case.compile), inputs, case.loss


def run_case(name: str, backend: str, grad_set: bool, optimizer: str | None = "adamw"):
    """``(truth, prediction)`` for one compiled model: truth from tests/_memtruth.measure, the prediction
    ``report.backward_memory(optimizer=opt, inputs=[...])`` (the batch the caller holds) made inside the
    profiled run, before backward."""
    model, cm, inputs, loss = build(name, backend)
    opt = OPTIMIZERS[optimizer](model) if optimizer else None
    if grad_set:
        loss(cm, *inputs).backward()
    # warm the in-node workspace cache (it does not measure while a profiler runs)
    gradscope.inspect(loss(cm, *inputs), model=cm).backward_memory(optimizer=opt, inputs=list(inputs))
    truth = measure(
        lambda: (loss(cm, *inputs), cm),
        before=list(inputs),
        optimizer=opt,
        inspect=lambda loss_, m: gradscope.inspect(loss_, model=m),
        predict=lambda r, o: r.backward_memory(optimizer=o, inputs=list(inputs)),
    )
    return truth, truth.prediction


def run_steps(name: str, backend: str, optimizer: str = "sgd"):
    """``(measured absolute peak per step, prediction)``: three real steps of a training loop (forward,
    backward, ``optimizer.step()``, ``zero_grad()``), the prediction asked between step 1's forward and
    backward; its ``first_step`` and ``later_step`` are the truth's first and highest later step."""
    model, cm, inputs, loss = build(name, backend)
    opt = OPTIMIZERS[optimizer](model)

    def predict(loss_):
        return gradscope.inspect(loss_, model=cm).backward_memory(optimizer=opt, inputs=list(inputs))

    predict(loss(cm, *inputs))  # the in-node cache is not measured under a profiler
    got = measure_steps(cm, lambda s, k: inputs, loss, opt, steps=3, before=list(inputs), predict=predict)
    return got["steps"], got["prediction"]
