"""The walk: structure, attributes, roots, freed graphs, opaque regions, devices, bad input."""

from __future__ import annotations

import json

import networkx as nx
import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import gradscope
from tests._truth import flagged, hooked_unique_bytes, kinds, none_grads

CONTRACT = {"kind", "name", "saved", "saved_bytes", "device", "module", "root"}
SAVED_KEYS = {"slot", "shape", "dtype", "device", "nbytes"}


def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def test_node_attributes_and_edges():
    m = mlp()
    loss = m(torch.randn(3, 4)).pow(2).mean()
    r = gradscope.inspect(loss, model=m)
    g = r.graph
    assert nx.is_directed_acyclic_graph(g)
    for n, d in g.nodes(data=True):
        assert CONTRACT <= set(d), n
        for e in d["saved"]:
            assert SAVED_KEYS <= set(e)
        if d["kind"] != "op":
            assert {"shape", "dtype", "requires_grad"} <= set(d)
    (root,) = [n for n, d in g.nodes(data=True) if d["root"]]
    assert g.nodes[root]["name"] == "MeanBackward0" and g.in_degree(root) == 1 and g.out_degree(root) == 0
    w0 = next(n for n, d in g.nodes(data=True) if d["name"] == "0.weight")
    assert g.nodes[w0] | {} and g.nodes[w0]["shape"] == [8, 4] and g.nodes[w0]["module"] == "0"
    # data flow: the weight feeds TBackward0, which feeds AddmmBackward0 at input index 2 (mat2)
    (t,) = g.successors(w0)
    assert g.nodes[t]["name"] == "TBackward0"
    (addmm,) = g.successors(t)
    assert g.nodes[addmm]["name"] == "AddmmBackward0" and g.edges[t, addmm]["index"] == 2
    tanh = next(d for _, d in g.nodes(data=True) if d["name"] == "TanhBackward0")
    assert tanh["saved"][0] | {} and tanh["saved"][0]["slot"] == "result"
    assert tanh["saved"][0]["shape"] == [3, 8] and tanh["saved"][0]["nbytes"] == 96
    json.dumps(nx.node_link_data(g))  # metadata only: plain JSON


def test_node_ids_are_deterministic():
    def build():
        torch.manual_seed(0)
        m = mlp()
        return gradscope.inspect(m(torch.randn(3, 4)).sum(), model=m)

    a, b = build(), build()
    assert list(a.graph.nodes(data="name")) == list(b.graph.nodes(data="name"))
    assert list(a.graph.edges(data=True)) == list(b.graph.edges(data=True))
    assert list(a.graph.nodes)[0] == "n0" and a.graph.nodes["n0"]["root"]


def test_negative_ints_restored():
    x = torch.randn(2, 3, 1, requires_grad=True)
    y = x.squeeze(-1).transpose(-1, -2).sum(dim=-1)
    g = gradscope.inspect(y.sum()).graph
    attrs = {d["name"]: d["attrs"] for _, d in g.nodes(data=True) if d["kind"] == "op"}
    assert attrs["SqueezeBackward1"]["dim"] == -1
    assert (attrs["TransposeBackward0"]["dim0"], attrs["TransposeBackward0"]["dim1"]) == (-1, -2)
    assert attrs["SumBackward1"]["dim"] == [-1]


def test_non_scalar_root():
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    r = gradscope.inspect(y)
    assert kinds(r) == ["non-scalar-root"] and r.findings[0].severity == "warning"
    with pytest.raises(RuntimeError, match="only for scalar outputs"):
        y.backward()


def test_multiple_roots_share_one_graph():
    m = mlp()
    h = m(torch.randn(3, 4))
    a, b = h[:, 0].sum(), h[:, 1].mean()
    r = gradscope.inspect([a, b], model=m)
    roots = [n for n, d in r.graph.nodes(data=True) if d["root"]]
    assert len(roots) == 2 and r.findings == []
    assert r.graph.graph["roots"] == roots
    single = gradscope.inspect(a, model=m).graph.number_of_nodes()
    assert single < r.graph.number_of_nodes()


def test_mixed_roots_no_grad_root_finding():
    x = torch.randn(3, requires_grad=True)
    r = gradscope.inspect([x.sum(), torch.ones(())])
    assert kinds(r) == ["no-grad-root"]


def test_root_that_is_a_leaf():
    x = torch.randn((), requires_grad=True)
    r = gradscope.inspect(x, params={"x": x})
    (n,) = r.graph.nodes
    assert r.graph.nodes[n]["kind"] == "param" and r.graph.nodes[n]["root"] and r.findings == []


@pytest.mark.parametrize("bad", [None, 3, "loss", [1, 2], []])
def test_bad_root_type(bad):
    with pytest.raises(TypeError, match="inspect"):
        gradscope.inspect(bad)


def test_tensor_without_grad():
    with pytest.raises(ValueError, match="no grad_fn and does not require grad"):
        gradscope.inspect(torch.ones(3).sum())


def test_bad_model_and_params():
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(TypeError, match="model= must be a torch.nn.Module"):
        gradscope.inspect(x.sum(), model="net")
    with pytest.raises(TypeError, match="params= must be a mapping"):
        gradscope.inspect(x.sum(), params=[x])
    with pytest.raises(gradscope.InputTypeError):
        gradscope.inspect(x.sum(), trace=object())


def test_after_backward_freed_graph():
    m = mlp()
    loss = m(torch.randn(3, 4)).pow(2).mean()
    before = gradscope.inspect(loss, model=m)
    loss.backward()
    after = gradscope.inspect(loss, model=m)
    assert kinds(after) == ["freed-graph"] and after.findings[0].severity == "error"   # backward() raises
    assert after.saved_bytes == 0 < before.saved_bytes
    assert list(after.graph.nodes(data="name")) == list(before.graph.nodes(data="name"))
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


def test_retain_graph_keeps_saved():
    m = mlp()
    loss = m(torch.randn(3, 4)).sum()
    before = gradscope.inspect(loss, model=m).saved_bytes
    loss.backward(retain_graph=True)
    r = gradscope.inspect(loss, model=m)
    assert r.findings == [] and r.saved_bytes == before


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_no_rerun_no_false_alarm(reentrant):
    block = Counting()
    head = nn.Linear(4, 1)
    model = nn.ModuleDict({"block": block, "head": head})
    x = torch.randn(2, 4, requires_grad=True)
    loss = head(checkpoint(block, x, use_reentrant=reentrant)).sum()
    calls = block.calls
    r = gradscope.inspect(loss, model=model)
    assert block.calls == calls  # never re-ran the forward
    assert flagged(r, "error") == set()
    if reentrant:
        assert [f.severity for f in r.findings] == ["warning"]
        assert "reentrant checkpoint" in r.findings[0].message and "CheckpointFunction" in r.findings[0].message
    else:
        statuses = {e["status"] for _, d in r.graph.nodes(data=True) for e in d["saved"]}
        assert "recomputed" in statuses and r.findings == []
    loss.backward()
    assert none_grads(model) == set()


def test_meta_device():
    m = mlp().to("meta")
    x = torch.randn(3, 4, device="meta")
    h = m[0](x)
    loss = (h * h).sum() + m[2](torch.tanh(h)).sum()
    r = gradscope.inspect(loss, model=m)
    devices = {d["device"] for _, d in r.graph.nodes(data=True)}
    assert devices == {"meta"}
    # h*h saves the same storage twice; tanh saves its own result: distinct storages despite data_ptr 0
    mul = next(d for _, d in r.graph.nodes(data=True) if d["name"] == "MulBackward0")
    assert mul["saved"][0]["storage"] == mul["saved"][1]["storage"]
    tanh = next(d for _, d in r.graph.nodes(data=True) if d["name"] == "TanhBackward0")
    assert tanh["saved"][0]["storage"] != mul["saved"][0]["storage"]
    truth, _ = hooked_unique_bytes(lambda: ((m[0](x) ** 1) * 1))  # sanity: hooks work on meta
    assert truth >= 0


def test_custom_function_named_after_class_and_not_opaque():
    class Mystery(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            ctx.k = 5
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    lin, other = nn.Linear(3, 3), nn.Linear(3, 3)
    model = nn.ModuleDict({"lin": lin, "other": other})
    loss = Mystery.apply(lin(torch.randn(2, 3))).sum()
    r = gradscope.inspect(loss, model=model)
    node = next(d for _, d in r.graph.nodes(data=True) if d["name"] == "MysteryBackward")
    assert node["function"].endswith("Mystery") and node["attrs"]["k"] == 5
    assert node["saved"][0]["shape"] == [2, 3]
    # A custom Function sends gradients only to its own inputs: "other" is certainly unused.
    assert [f.severity for f in r.findings] == ["error"]
    assert set(r.findings[0].params) == {"other.weight", "other.bias"}
    loss.backward()
    assert other.weight.grad is None and other.bias.grad is None and lin.weight.grad is not None


def test_save_on_cpu_is_not_copied_back():
    m = mlp()
    with torch.autograd.graph.save_on_cpu():
        loss = m(torch.randn(3, 4)).sum()
    r = gradscope.inspect(loss, model=m)
    statuses = {e["status"] for _, d in r.graph.nodes(data=True) for e in d["saved"]}
    assert statuses == {"offloaded"} and r.saved_bytes == 0
    loss.backward()
    assert none_grads(m) == set()


def test_saved_bytes_equal_hooks_on_transformer_block():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True,
                                       dropout=0.1)
    x = torch.randn(2, 5, 32)
    torch.manual_seed(1)
    truth, _ = hooked_unique_bytes(lambda: layer(x).pow(2).mean())
    torch.manual_seed(1)
    loss = layer(x).pow(2).mean()
    r = gradscope.inspect(loss, model=layer)
    assert r.saved_bytes == truth > 0
    assert r.findings == []
