"""torch.compile with a graph break through numpy: the region before ``.numpy()`` gets no gradient,
exactly as in eager, and plain ``inspect`` / ``explain`` (and a traced one) say so. tests/compiled holds
the compiled-models issue's own case; these are two more programs and a healthy twin whose numpy use
(the input's statistics, a logged value) cuts nothing. torch's ``.grad`` after ``backward()`` is the judge.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import gradscope


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class NumpyNorm(nn.Module):
    """The encoder's output normalised in numpy, then fed on: the encoder trains in neither mode."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.encoder(x).cpu().detach().numpy()
        h = torch.from_numpy(h / (np.linalg.norm(h, axis=1, keepdims=True) + 1e-6))
        return self.head(h.float()).square().mean()


class NumpyGate(nn.Module):
    """A gate computed in numpy from a layer's output multiplies the trunk: the gate layer gets no gradient."""

    def __init__(self):
        super().__init__()
        self.trunk, self.gate = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        g = torch.as_tensor(np.clip(self.gate(x).detach().numpy(), 0.0, 1.0))
        return (self.trunk(x) * g).sum()


class NumpyOfInput(nn.Module):
    """The healthy twin: numpy reads only the input and logs a value; every layer trains."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Linear(8, 1)
        self.seen = []

    def forward(self, x):
        scale = torch.from_numpy(np.abs(x.numpy()).mean(axis=1, keepdims=True)).float()
        h = self.encoder(x / (scale + 1e-6))
        self.seen.append(float(h.detach().mean().numpy()))
        return self.head(h).square().mean()


def _run(cls):
    """[(report, parameters whose .grad is None)] plain, then traced, of one compiled model (compiled once)."""
    torch.manual_seed(0)
    model = cls()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(3, 4)
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for traced in (False, True):
            model.zero_grad(set_to_none=True)
            if traced:
                with gradscope.trace() as tr:
                    loss = compiled(x)
                report = gradscope.inspect(loss, model=compiled, trace=tr)
            else:
                loss = compiled(x)
                report = gradscope.inspect(loss, model=compiled)
            loss.backward()
            out.append((report, {n for n, p in model.named_parameters() if p.grad is None}))
    return out


def _flagged(report) -> set[str]:
    kinds = ("unused-parameter", "detached-branch")
    return {p for f in report.findings if f.kind in kinds and f.severity == "error" for p in f.params}


@pytest.mark.parametrize(
    "cls,lost",
    [(NumpyNorm, {"encoder.0.weight", "encoder.0.bias"}), (NumpyGate, {"gate.weight", "gate.bias"})],
    ids=["norm", "gate"],
)
def test_the_region_before_numpy_gets_no_gradient_and_inspect_says_so(cls, lost):
    (plain, none_plain), (traced, none_traced) = _run(cls)
    param = sorted(lost)[0]
    for report, none in ((plain, none_plain), (traced, none_traced)):
        assert none == lost == _flagged(report)
        text = report.explain(param)
        assert ("will stay None" in text or ".grad stays None" in text) and "_orig_mod" not in text
    cut = next(f for f in traced.findings if param in f.params)
    assert cut.kind == "detached-branch" and "numpy" in cut.message and cut.location


def test_numpy_of_the_input_and_a_logged_value_is_clean():
    for report, none in _run(NumpyOfInput):
        assert none == set() == _flagged(report)
        assert [f for f in report.findings if f.severity == "error"] == []
