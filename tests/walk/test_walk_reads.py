"""Walk-level regressions, each against torch's own behaviour: nested tensors, freed tensor
lists, custom Functions freed by an earlier backward."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from click.testing import CliRunner

import gradscope
from gradscope.cli.commands import main
from tests._truth import hooked_unique_bytes, kinds
from tests.fuzz._vocab import ExpF

warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")

_SECOND = "backward through the graph a second time"


def _nested_loss():
    a = torch.randn(2, 3, requires_grad=True)
    nt = torch.nested.as_nested_tensor([a * 2, a[:1] * 3])
    return torch.nested.to_padded_tensor(nt.sin(), 0.0).sum(), a


def test_nested_tensors_are_read_not_crashed_on(tmp_path):
    loss, a = _nested_loss()
    r = gradscope.inspect(loss, params={"a": a})
    g = r.graph
    nested = [e for _, d in g.nodes(data=True) for e in d["saved"] if e["shape"] is None]
    # SinBackward0 and ToPaddedTensorBackward0 save the nested tensor: no shape, but its storage is real
    assert len(nested) == 2 and all(e["status"] == "live" and e["nbytes"] == 36 for e in nested)
    truth, _ = hooked_unique_bytes(lambda: _nested_loss()[0])   # what torch's pack hooks see
    assert r.saved_bytes == truth == 36 * 2 + 24 + 12               # two nested buffers, the list
    assert "?" in r.summary() and not r.findings
    r.render(tmp_path / "n.dot")
    json.dumps(r.to_json())
    loss.backward()                                 # torch runs this graph: so must the report say
    assert a.grad is not None


def test_cli_check_on_a_nested_tensor_graph_prints_no_traceback(tmp_path):
    target = tmp_path / "nt.py"
    target.write_text(
        "import torch\n"
        "def make():\n"
        "    a = torch.randn(2, 3, requires_grad=True)\n"
        "    nt = torch.nested.as_nested_tensor([a * 2, a[:1] * 3])\n"
        "    return torch.nested.to_padded_tensor(nt.sin(), 0.0).sum()\n")
    res = CliRunner().invoke(main, ["check", f"{target}:make"])
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output and "No findings" in res.output


class _Cached(torch.nn.Module):
    """Gathers rows of its weight once, in __init__, and reuses them every step (a classic bug)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 3))
        self.rows = self.w[torch.tensor([0, 2])]    # IndexBackward0 saves its indices as a tensor list

    def forward(self, x):
        return (self.rows * x).sum()


def test_freed_tensor_list_is_a_freed_slot():
    m = _Cached()
    m(torch.randn(2, 3)).backward()                 # step 1 frees IndexBackward0's indices
    loss = m(torch.randn(2, 3))
    r = gradscope.inspect(loss, model=m)
    assert "freed-graph" in kinds(r)
    f = next(f for f in r.findings if f.kind == "freed-graph")
    assert r.graph.nodes[f.node]["name"] == "IndexBackward0"
    assert [e["status"] for e in r.graph.nodes[f.node]["saved"]] == ["freed"]
    with pytest.raises(RuntimeError, match=_SECOND):
        loss.backward()


def test_live_tensor_list_is_not_freed():
    m = _Cached()
    loss = m(torch.randn(2, 3))
    r = gradscope.inspect(loss, model=m)
    assert "freed-graph" not in kinds(r)
    idx = next(d for _, d in r.graph.nodes(data=True) if d["name"] == "IndexBackward0")
    assert [(e["slot"], e["status"], e["dtype"]) for e in idx["saved"]] == [("indices[0]", "live", "int64")]
    loss.backward()


class _SavesNothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.k = 2
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k


def _used_after_a_backward(function):
    """``function`` applied to a parameter, one backward, then its output used again: ``(p, loss, report)``."""
    p = torch.nn.Parameter(torch.randn(4))
    y = function.apply(p)
    y.sum().backward()
    loss = (y + 1).sum()
    return p, loss, gradscope.inspect(loss, params={"p": p})


def test_custom_function_freed_by_an_earlier_backward():
    _, loss, r = _used_after_a_backward(ExpF)
    assert "freed-graph" in kinds(r)
    f = next(f for f in r.findings if f.kind == "freed-graph")
    assert r.graph.nodes[f.node]["name"] == "ExpFBackward"
    with pytest.raises(RuntimeError, match=_SECOND):
        loss.backward()


def test_custom_function_that_saved_nothing_is_not_freed():
    p, loss, r = _used_after_a_backward(_SavesNothing)
    assert "freed-graph" not in kinds(r)
    loss.backward()                                 # torch agrees: nothing was freed that it needs
    assert p.grad is not None


def test_nested_tensor_root_is_a_non_scalar_root():
    a = torch.randn(2, 3, requires_grad=True)
    root = torch.nested.as_nested_tensor([a * 2, a[:1] * 3]).sin()
    r = gradscope.inspect(root, params={"a": a})
    assert kinds(r) == ["non-scalar-root"] and "nested tensor" in r.findings[0].message
    assert r.graph.graph["root_shapes"] == [None]
    with pytest.raises(RuntimeError, match="only for scalar outputs"):
        root.backward()
