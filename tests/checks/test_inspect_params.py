"""unused-parameter / clean models: predictions compared with which .grad torch leaves None."""

from __future__ import annotations

import torch
import torch.nn as nn

import gradscope
from tests._truth import flagged, none_grads


def check_against_torch(model, loss, expect_flagged=None):
    report = gradscope.inspect(loss, model=model)
    predicted = flagged(report)
    loss.backward()
    truth = none_grads(model)
    assert predicted == truth, report.summary()
    if expect_flagged is not None:
        assert predicted == set(expect_flagged)
    return report


class TwoHeads(nn.Module):
    def __init__(self, cut):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.a = nn.Linear(8, 2)
        self.b = nn.Linear(8, 2)
        self.unused = nn.Linear(3, 3)
        self.cut = cut

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.a(h).sum() + self.cut(self.b, h)


def test_unused_submodule():
    m = TwoHeads(lambda b, h: b(h).sum())
    r = check_against_torch(m, m(torch.randn(5, 4)), {"unused.weight", "unused.bias"})
    (f,) = r.findings
    assert f.kind == "unused-parameter" and f.severity == "error" and f.node is None
    assert "unused.weight" in f.message and "no gradient" in f.message


def test_detach_cut():
    m = TwoHeads(lambda b, h: b(h).detach().sum())
    check_against_torch(m, m(torch.randn(5, 4)), {"unused.weight", "unused.bias", "b.weight", "b.bias"})


def test_data_cut():
    m = TwoHeads(lambda b, h: b(h).data.sum())
    check_against_torch(m, m(torch.randn(5, 4)), {"unused.weight", "unused.bias", "b.weight", "b.bias"})


def _no_grad_head(b, h):
    with torch.no_grad():
        out = b(h)
    return out.sum()


def test_no_grad_block():
    m = TwoHeads(_no_grad_head)
    check_against_torch(m, m(torch.randn(5, 4)), {"unused.weight", "unused.bias", "b.weight", "b.bias"})


def test_argmax_integer_path():
    m = TwoHeads(lambda b, h: b(h).argmax(dim=1).float().sum())
    check_against_torch(m, m(torch.randn(5, 4)), {"unused.weight", "unused.bias", "b.weight", "b.bias"})


def test_frozen_backbone_is_clean():
    m = TwoHeads(lambda b, h: b(h).sum())
    del m.unused
    m.body.requires_grad_(False)
    r = check_against_torch(m, m(torch.randn(5, 4)), set())
    assert r.findings == []
    assert "frozen" in r.explain("body.weight")


def test_tied_weights_clean():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 6)
            self.out = nn.Linear(6, 10, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, idx):
            return self.out(self.emb(idx)).logsumexp(-1).mean()

    m = Tied()
    r = check_against_torch(m, m(torch.tensor([1, 2, 3])), set())
    assert r.findings == []
    params = [d for _, d in r.graph.nodes(data=True) if d["kind"] == "param"]
    assert [d["name"] for d in params] == ["emb.weight"]


def test_params_mapping_and_inputs():
    w = torch.randn(3, 3, requires_grad=True)
    unused = torch.randn(3, requires_grad=True)
    x = torch.randn(2, 3, requires_grad=True)
    loss = (x @ w).sum()
    r = gradscope.inspect(loss, params={"w": w, "unused": unused})
    kinds = {d["name"]: d["kind"] for _, d in r.graph.nodes(data=True) if d["kind"] != "op"}
    assert kinds == {"w": "param", "input": "input"}
    assert flagged(r) == {"unused"}
    loss.backward()
    assert unused.grad is None and w.grad is not None


def test_explain_reached_and_unknown():
    m = TwoHeads(lambda b, h: b(h).sum())
    r = gradscope.inspect(m(torch.randn(5, 4)), model=m)
    assert "reached" in r.explain("a.weight")
    assert "unused.weight" in r.explain("unused.weight")
    import pytest

    with pytest.raises(KeyError, match="Did you mean 'a.weight'"):
        r.explain("a.weigth")


def test_ddp_style_wrapper_names_without_prefix():
    m = TwoHeads(lambda b, h: b(h).sum())
    wrapper = nn.DataParallel(m)  # CPU: DataParallel just calls the module
    r = gradscope.inspect(wrapper(torch.randn(5, 4)), model=wrapper)
    assert flagged(r) == {"unused.weight", "unused.bias"}
