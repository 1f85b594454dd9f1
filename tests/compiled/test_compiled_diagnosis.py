"""Missing gradients inside torch.compile regions, judged by torch's own ``.grad`` after backward.

A compiled region is one ``CompiledFunctionBackward`` node with an edge to every parameter it read; its
backward graph (read before backward, walk/compiled.py) returns None for the ones a cut inside the
compiled code leaves without a gradient. Names are the user's (no ``_orig_mod.``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import gradscope


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Cuts(nn.Module):
    """``a`` cut by .detach(), ``b`` under no_grad, ``unused`` never called, ``c`` trains."""

    def __init__(self, graph_break: bool = False, data: bool = False):
        super().__init__()
        self.a, self.b, self.c, self.unused = (nn.Linear(4, 4) for _ in range(4))
        self.graph_break, self.data = graph_break, data

    def forward(self, x):
        h = self.a(x).data if self.data else self.a(x).detach()
        with torch.no_grad():
            g = self.b(x)
        if self.graph_break:
            torch._dynamo.graph_break()
        return self.c(x + h + g).sum()


class Healthy(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(4 * 8 * 8, 2)
        self.frozen = nn.Linear(2, 2).requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.head(self.act(self.conv(x)).flatten(1))).square().mean()


def _no_grad_after_backward(model, loss) -> set[str]:
    loss.backward()
    return {n for n, p in model.named_parameters() if p.requires_grad and p.grad is None}


def _flagged(report) -> set[str]:
    return {p for f in report.findings if f.kind in ("unused-parameter", "detached-branch") for p in f.params}


CASES = [
    pytest.param(dict(backend="aot_eager"), {}, id="aot_eager"),
    pytest.param(dict(backend="aot_eager"), dict(graph_break=True), id="graph-break"),
    pytest.param(dict(backend="aot_eager"), dict(data=True), id="data"),
    pytest.param(dict(backend="aot_eager", fullgraph=True), {}, id="fullgraph"),
    pytest.param(dict(backend="aot_eager", dynamic=True), {}, id="dynamic"),
    pytest.param(dict(backend="inductor"), {}, id="inductor"),
]


@pytest.mark.parametrize(("compile_kw", "model_kw"), CASES)
def test_cuts_inside_a_compiled_model_match_torchs_grads(compile_kw, model_kw):
    model = Cuts(**model_kw)
    compiled = torch.compile(model, **compile_kw)
    loss = compiled(torch.randn(3, 4))
    report = gradscope.inspect(loss, model=compiled)
    flagged = _flagged(report)
    assert flagged == _no_grad_after_backward(model, loss)
    assert flagged == {f"{m}.{p}" for m in ("a", "b", "unused") for p in ("weight", "bias")}
    assert not any("_orig_mod" in f.message for f in report.findings)


def test_traced_cuts_inside_a_compiled_model_carry_their_lines():
    model = Cuts()
    compiled = torch.compile(model, backend="aot_eager")
    with gradscope.trace() as tr:
        loss = compiled(torch.randn(3, 4))
    report = gradscope.inspect(loss, model=compiled, trace=tr)
    by_param = {p: f for f in report.findings for p in f.params}
    src = Cuts.forward.__code__.co_firstlineno
    assert by_param["a.weight"].kind == "detached-branch" and ".detach()" in by_param["a.weight"].message
    assert by_param["a.weight"].location.endswith(f":{src + 1}")
    assert by_param["b.weight"].kind == "detached-branch" and by_param["b.weight"].location.endswith(f":{src + 3}")
    assert "never called" in by_param["unused.weight"].message
    assert set(by_param) == _no_grad_after_backward(model, loss)


def test_explain_takes_the_users_name_with_or_without_orig_mod():
    model = Cuts()
    compiled = torch.compile(model, backend="aot_eager")
    report = gradscope.inspect(compiled(torch.randn(3, 4)), model=compiled)
    plain, prefixed = report.explain("a.weight"), report.explain("_orig_mod.a.weight")
    assert plain == prefixed and "no gradient" in plain and "_orig_mod" not in plain
    assert "c.weight" in report.graph.graph["params"] and "_orig_mod.c.weight" not in report.graph.graph["params"]


def test_a_healthy_compiled_model_is_clean():
    model = Healthy()
    compiled = torch.compile(model, backend="aot_eager")
    loss = compiled(torch.randn(2, 3, 8, 8))
    report = gradscope.inspect(loss, model=compiled)
    assert report.ok and not _flagged(report)
    assert _no_grad_after_backward(model, loss) == set()


def test_a_compiled_function_with_a_cut_inside():
    w1, w2 = (torch.randn(4, 4, requires_grad=True) for _ in range(2))

    @torch.compile(backend="aot_eager")
    def step(x):
        return (x @ w1).detach().sum() + (x @ w2).sum()

    loss = step(torch.randn(2, 4))
    report = gradscope.inspect(loss, params={"w1": w1, "w2": w2})
    assert _flagged(report) == {"w1"}
    loss.backward()
    assert w1.grad is None and w2.grad is not None


class ThroughNumpy(nn.Module):
    """A graph break through numpy: ``first``'s output leaves autograd in ``.numpy()``."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        h = self.first(x)
        h = torch.from_numpy(np.tanh(h.detach().numpy()))
        return self.second(h).sum()


def test_a_graph_break_through_numpy_leaves_the_first_region_without_gradients():
    model = ThroughNumpy()
    compiled = torch.compile(model, backend="aot_eager")
    loss = compiled(torch.randn(2, 4))
    report = gradscope.inspect(loss, model=compiled)
    assert _flagged(report) == {"first.weight", "first.bias"} == _no_grad_after_backward(model, loss)
    assert "no gradient" in report.explain("first.weight")
