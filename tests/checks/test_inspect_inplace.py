"""inplace-hazard: predicted before backward, confirmed by backward raising (or not)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import gradscope
from tests._memmodels import BasicBlock
from tests._truth import backward_raises_inplace, kinds
from tests.fuzz._vocab import MulF


def _hazards(report):
    return [f for f in report.findings if f.kind == "inplace-hazard"]


@pytest.mark.parametrize("op,node", [(torch.sigmoid, "SigmoidBackward0"), (torch.exp, "ExpBackward0"),
                                     (torch.tanh, "TanhBackward0")])
def test_output_modified_in_place(op, node):
    x = torch.randn(4, requires_grad=True)
    y = op(x)
    y.mul_(2)
    loss = y.sum()
    versions = (x._version, y._version)
    report = gradscope.inspect(loss)
    assert (x._version, y._version) == versions  # inspecting changed nothing
    (f,) = _hazards(report)
    assert report.graph.nodes[f.node]["name"] == node
    assert "its own output" in f.message and "'result'" not in f.message and "(4,)" in f.message
    assert "version 0" in f.message and "version 1" in f.message
    assert "out-of-place" in f.message
    assert backward_raises_inplace(loss)


def test_saved_input_modified_in_place():
    x = torch.randn(3, requires_grad=True)
    h = x * 1
    p = h * h
    torch.relu_(h)
    r = gradscope.inspect(p.sum())
    (f,) = _hazards(r)
    assert r.graph.nodes[f.node]["name"] == "MulBackward0" and "the output of Mul" in f.message
    assert "'self'" not in f.message
    assert backward_raises_inplace(p.sum())


def test_mul_by_scalar_then_add_is_clean():
    x = torch.randn(4, requires_grad=True)
    y = x * 2
    y.add_(1)
    loss = y.sum()
    r = gradscope.inspect(loss)
    assert r.findings == []
    assert not backward_raises_inplace(loss)
    assert torch.equal(x.grad, torch.full((4,), 2.0))


def test_sigmoid_then_inplace_relu_is_hazard():
    x = torch.randn(2, 4, requires_grad=True)
    m = nn.Sequential(nn.Sigmoid(), nn.ReLU(inplace=True))
    loss = m(x).sum()
    assert kinds(gradscope.inspect(loss)) == ["inplace-hazard"]
    assert backward_raises_inplace(loss)


def test_resnet_block_with_inplace_relu_is_clean():
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                      BasicBlock(8), BasicBlock(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    loss = nn.functional.cross_entropy(m(torch.randn(2, 3, 8, 8)), torch.tensor([1, 4]))
    r = gradscope.inspect(loss, model=m)
    assert r.findings == [], r.summary()
    assert not backward_raises_inplace(loss)
    assert all(p.grad is not None for p in m.parameters())


def test_linear_then_inplace_relu_is_clean():
    m = nn.Sequential(nn.Linear(4, 3), nn.ReLU(inplace=True))
    loss = m(torch.randn(2, 4)).sum()
    assert gradscope.inspect(loss, model=m).findings == []
    assert not backward_raises_inplace(loss)


def test_custom_function_saved_tensor_modified():
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(3, requires_grad=True) * 1
    y = MulF.apply(x, w)
    x.add_(1)
    loss = y.sum()
    r = gradscope.inspect(loss, params={"w": w})
    (f,) = _hazards(r)
    assert r.graph.nodes[f.node]["name"] == "MulFBackward"
    assert backward_raises_inplace(loss)
