"""Scale: inferred modules, collapsing to a module depth, folding unrolled repetition, automatic collapse."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import gradscope
from gradscope.views.collapse import build_view, find_folds, infer_modules, lcp
from tests._render_models import lstm


def _dot_nodes(src: str) -> int:
    return len(re.findall(r"^\t+\S+ \[label=", src, flags=re.M))


class Block(nn.Module):
    def __init__(self, d: int = 6):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.inner(x))


class Deep(nn.Module):
    def __init__(self, n: int = 3, d: int = 6):
        super().__init__()
        self.layers = nn.Sequential(*(Block(d) for _ in range(n)))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.layers(x)).pow(2).mean()


@pytest.fixture
def deep():
    model = Deep()
    loss = model(torch.randn(2, 6))
    return gradscope.inspect(loss, model=model), model


def test_lcp():
    assert lcp("a.b.c", "a.b.d") == "a.b"
    assert lcp("a", "b") is None and lcp(None, "a") is None and lcp("x.y", "x.y") == "x.y"


def test_modules_are_inferred_from_consumed_parameters(deep):
    report, model = deep
    mods = infer_modules(report.graph)
    names = {m for m, _ in model.named_modules() if m}
    for n, d in report.graph.nodes(data=True):
        if d["kind"] == "op" and mods[n] is not None:
            assert mods[n] in names, (d["name"], mods[n])
    relus = [n for n, d in report.graph.nodes(data=True) if d["name"] == "ReluBackward0"]
    # the ReLU sits between layers.K.inner.0 and layers.K.inner.2: it belongs to layers.K.inner
    assert sorted(mods[n] for n in relus) == [f"layers.{k}.inner" for k in range(3)]
    addmm_params = {mods[v] for u, v in report.graph.edges()
                    if report.graph.nodes[u]["name"] == "layers.1.inner.0.bias"}
    assert addmm_params == {"layers.1.inner.0"}


def test_collapse_depth_folds_deeper_modules_into_boxes(deep):
    report, _ = deep
    view = build_view(report.graph, report.findings, collapse=1, fold=False)   # whole calls would fold (x3)
    boxes = {g.title: g for g in view.groups.values() if g.kind == "module"}
    assert set(boxes) == {"layers.0", "layers.1", "layers.2"}
    ops = [n for n, d in report.graph.nodes(data=True) if d["kind"] == "op"]
    mods = infer_modules(report.graph)
    for n in ops:                                        # every op inside layers.K is in box layers.K
        m = mods[n]
        if m and m.startswith("layers.") and not report.graph.nodes[n].get("root"):
            assert view.owner[n] == f"module:{'.'.join(m.split('.')[:2])}"
    assert sum(g.n_ops for g in boxes.values()) == sum(1 for n in ops if n in view.owner)
    src = report.to_dot(collapse=1).source
    assert 'id="module:layers.1"' in src and "layers.1  (collapsed)" in src
    assert re.search(r"layers\.1  \(collapsed\)\\n\d+ ops, [\d.]+ \w?i?B saved", src)
    full = report.to_dot(collapse=False).source
    assert _dot_nodes(src) < _dot_nodes(full)


def test_a_finding_keeps_its_module_open_at_any_depth():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Sequential(nn.Linear(3, 3), nn.Sigmoid(), nn.Linear(3, 1))
            self.other = nn.Sequential(nn.Linear(3, 3), nn.Tanh())

        def forward(self, x):
            h = self.enc[1](self.enc[0](x))
            out = self.enc[2](h) + self.other(x).sum()
            h.add_(1)
            return out.sum()

    model = Bad()
    loss = model(torch.randn(2, 3))
    report = gradscope.inspect(loss, model=model)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    src = report.to_dot(collapse=0).source
    assert 'label="enc  (collapsed)' not in src          # the module holding the finding stays open
    assert re.search(r'label="SigmoidBackward0[^"]*!! inplace-hazard"[^\]]*gs-finding', src)
    assert 'label="other  (collapsed)' in src            # its sibling without a finding is boxed
    clean = build_view(report.graph, [], collapse=0)     # without the finding, enc is boxed too
    assert {"module:enc", "module:other"} <= set(clean.groups)


def test_find_folds_on_a_periodic_string():
    toks = [9, 8] + [1, 2, 3] * 10 + [7]
    assert find_folds(toks, min_reps=4, min_ops=6) == [(2, 3, 10)]
    assert find_folds([1, 2, 3, 4, 5, 6] * 2) == []


def test_unrolled_lstm_folds_into_one_xN_box_by_default():
    loss, model = lstm(200)
    report = gradscope.inspect(loss, model=model)
    n = report.graph.number_of_nodes()
    assert n > 2000
    src = report.to_dot().source
    assert _dot_nodes(src) < 60                          # far fewer drawn nodes than graph nodes
    assert re.search(r'label="x(199|200)  repeated block', src)
    assert "Drawn to fit a page" in src and "collapse=False" in src
    view = build_view(report.graph, report.findings)
    fold = next(g for g in view.groups.values() if g.kind == "fold")
    assert fold.reps in (199, 200) and fold.module == "cell"
    assert fold.n_ops == fold.reps * len(fold.pattern)
    full = report.to_dot(collapse=False).source
    assert _dot_nodes(full) >= n - 4                     # expanded: every node (shared weights as stubs)
    assert "repeated block" not in full and "shared x200" in full
    # the weights are shared by all steps; torch agrees: one .grad accumulates all of them
    loss.backward()
    assert model.cell.weight_ih.grad is not None


def test_long_chain_folds_and_small_graphs_do_not():
    w = nn.Parameter(torch.ones(3))
    y = w * 1.0
    for i in range(1500):
        y = y.sin() if i % 2 else y * 1.5
    report = gradscope.inspect(y.sum(), params={"w": w})
    src = report.to_dot().source
    assert re.search(r'label="x7\d\d  repeated block \(2 ops each\)', src)
    assert _dot_nodes(src) < 10
    small = report.to_dot(fold=False, collapse=False).source     # asked for: nothing folded
    assert "repeated block" not in small and "Drawn to fit" not in small


def test_small_graphs_are_drawn_in_full_by_default(deep):
    report, _ = deep
    src = report.to_dot().source
    assert "gs-group" not in src and "Drawn to fit" not in src
    n_ops = sum(1 for _, d in report.graph.nodes(data=True) if d["kind"] == "op")
    assert src.count('class="gs-op') == n_ops


def test_auto_collapse_uses_module_depth_when_needed(deep):
    report, _ = deep
    src = report.to_dot(limit=20, fold=False).source     # at most 20 elements: modules boxed
    assert "Drawn to fit a page" in src and "(collapsed)" in src
    assert _dot_nodes(src) <= 20 < report.graph.number_of_nodes()


def test_a_module_called_twice_gets_one_box_per_call():
    """torchvision's BasicBlock calls one ReLU module twice: one box per call, so no cycle."""
    import networkx as nx

    from tests._fold_models import BasicBlock

    block = BasicBlock(3, 3)
    with gradscope.trace() as tr:
        loss = block(torch.randn(1, 3, 4, 4)).sum()
    report = gradscope.inspect(loss, model=block, trace=tr)
    view = build_view(report.graph, report.findings, collapse=0)
    relu = [g for g in view.groups.values() if g.title == "relu"]
    assert sorted(g.gid for g in relu) == ["module:relu", "module:relu#2"]
    drawn = nx.DiGraph()
    for u, v in report.graph.edges():
        drawn.add_edge(view.owner.get(u, u), view.owner.get(v, v))
    drawn.remove_edges_from(nx.selfloop_edges(drawn))
    assert nx.is_directed_acyclic_graph(drawn)


def test_the_module_holding_a_finding_is_open_down_to_its_node():
    from tests._render_models import hf_model

    pytest.importorskip("transformers")
    loss, model = hf_model("gpt2", 2, planted=True)
    report = gradscope.inspect(loss, model=model)
    hazard = next(f for f in report.findings if f.kind == "inplace-hazard")
    for depth in range(0, 4):
        view = build_view(report.graph, report.findings, collapse=depth, fold=True)
        assert hazard.node not in view.owner             # never inside a box
        assert view.module_of[hazard.node] in view.keep_open
