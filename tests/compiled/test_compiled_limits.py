"""Where a compiled region is read, where it is not, and what gradscope says then; plus the CLI and watch.

Judged by torch: ``.grad`` after a real backward, the exception ``watch`` raises, the CLI's exit code.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from click.testing import CliRunner

import gradscope
from gradscope.cli.commands import main
from tests.compiled import _models as M


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _flagged(report, severity=None) -> set[str]:
    return {
        p
        for f in report.findings
        if f.kind in ("unused-parameter", "detached-branch") and (severity is None or f.severity == severity)
        for p in f.params
    }


def _no_grad(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad and p.grad is None}


MLP_CUT = {"fc2.weight", "fc2.bias", "aux.weight", "aux.bias"}


def test_a_region_whose_backward_graph_is_gone_gets_a_sentence_not_a_traceback(monkeypatch):
    model = M.MLP()
    compiled = torch.compile(model, backend="aot_eager")
    loss = compiled(M.example(model))
    fwd = type(loss.grad_fn)._forward_cls
    monkeypatch.setattr(fwd, "_lazy_backward_info", None)  # a torch that drops it once compiled
    report = gradscope.inspect(loss, model=compiled)
    (warn,) = [f for f in report.findings if f.severity == "warning"]
    assert "not readable" in warn.message and "torch._dynamo.reset()" in warn.message
    assert "before the first backward" in warn.message and "_orig_mod" not in warn.message
    assert set(warn.params) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"}
    assert "not readable" in report.explain("fc2.weight")
    loss.backward()
    assert "fc2.weight" in _no_grad(model)  # the region did cut it: the warning is not a false alarm


def test_inspect_after_a_first_backward_with_retain_graph_still_reads_the_region():
    model = M.MLP()
    compiled = torch.compile(model, backend="aot_eager")
    loss = compiled(M.example(model))
    loss.backward(retain_graph=True)  # the backward is compiled now; torch 2.13 keeps bw_module
    report = gradscope.inspect(loss, model=compiled)
    assert _flagged(report) == _no_grad(model) == MLP_CUT
    assert not [f for f in report.findings if f.severity == "warning"]


def test_compiled_autograd_leaves_the_forward_graph_readable():
    model = M.MLP()
    compiled = torch.compile(model, backend="aot_eager")
    with torch._dynamo.config.patch(compiled_autograd=True):
        loss = compiled(M.example(model))
        report = gradscope.inspect(loss, model=compiled)
        loss.backward()  # run by compiled autograd
    assert _flagged(report) == _no_grad(model) == MLP_CUT


def test_a_compiled_function_with_dynamic_shapes():
    w1, w2, w3 = (torch.randn(4, 4, requires_grad=True) for _ in range(3))

    @torch.compile(backend="aot_eager", dynamic=True)
    def step(x):
        with torch.no_grad():
            h = x @ w1
        return (h @ w2).sum() + (x @ w3).detach().sum()

    loss = step(torch.randn(5, 4))
    report = gradscope.inspect(loss, params={"w1": w1, "w2": w2, "w3": w3})
    cut = [f for f in report.findings if f.kind == "detached-branch"]
    loss.backward()
    assert _flagged(report) == {"w1", "w3"} == {n for n, w in (("w1", w1), ("w2", w2), ("w3", w3)) if w.grad is None}
    assert cut and "step" in cut[0].message and cut[0].location.startswith("test_compiled_limits.py:")


def test_watch_names_the_users_parameters_on_a_compiled_model():
    model = M.MLP()
    with gradscope.watch(model) as _:
        compiled = torch.compile(model, backend="aot_eager")
        with pytest.raises(gradscope.GradientError) as err:
            compiled(M.example(model)).backward()
    named = {p for f in err.value.findings for p in f.params}
    assert named == _no_grad(model) == MLP_CUT
    assert "_orig_mod" not in str(err.value)


_TARGET = '''
import torch
import torch.nn as nn


class Cut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        return self.b(self.a(x).detach()).sum()


def make_loss():
    torch.manual_seed(0)
    model = torch.compile(Cut(), backend="aot_eager")
    return model(torch.randn(2, 4)), model
'''


@pytest.mark.parametrize("trace", ["--no-trace", "--trace"])
def test_cli_check_on_a_compiled_target(tmp_path, monkeypatch, trace):
    monkeypatch.setenv("GRADSCOPE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(_TARGET))
    result = CliRunner().invoke(main, ["check", f"{path}:make_loss", trace])
    assert result.exit_code == 1, result.output
    assert "a.weight" in result.output and "_orig_mod" not in result.output
    assert "train.py:" in result.output and "Traceback" not in result.output
