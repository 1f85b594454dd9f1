"""The compact records (NOTE [compact records]) against the DiGraph, and the walk's two readers.

* What inspect() answers from the compact form (findings, summary(), saved_bytes, the facade queries) is
  what the same code answers from ``report.graph``, and ``report.graph`` is built only when touched.
* The fast path of the walk and the general saved-slot reader (``walk/saved.py``) give the same node
  attributes, edges and graph attributes on every test graph (NOTE [walk fast path]).
Graphs: tests/walk/_graphs.py (every walk branch) and random programs of the differential fuzzer.
"""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import gradscope
from gradscope.checks import run_checks
from gradscope.report import held_bytes
from gradscope.views.text import top_nodes
from gradscope.walk.build import build, flatten_roots, param_names
from tests.fuzz._program import programs, run_program
from tests.walk._graphs import GRAPHS

_FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _compact_agrees(root, params) -> None:
    report = gradscope.inspect(root, params=params)
    assert report._graph is None                      # nothing built the DiGraph so far
    view = report.peek_graph()
    # the checks read the compact form: node dicts only for what the fast path left to the general
    # reader, the roots, and the nodes a finding names (a full scan made every node's dict)
    compact = view.compact
    named = {int(f.node[1:]) for f in report.findings if f.node in view}
    made = set(compact._dicts)
    assert made <= set(compact.special) | set(compact.roots) | named, made
    text = report.summary()
    answers = (dict(view.nodes(data="kind")), dict(view.nodes(data="saved_bytes")),
               dict(view.nodes(data="module")), view.compact.n_slots_total(), top_nodes(view, 5),
               view.number_of_nodes(), list(view.nodes))
    assert report._graph is None                      # summary() read the compact form only
    g = report.graph
    assert isinstance(g, nx.DiGraph) and report.graph is g
    expected = (dict(g.nodes(data="kind")), dict(g.nodes(data="saved_bytes")), dict(g.nodes(data="module")),
                sum(len(d["saved"]) for _, d in g.nodes(data=True)), top_nodes(g, 5), g.number_of_nodes(),
                list(g.nodes))
    assert answers == expected
    assert report.summary() == text
    assert run_checks(g) == report.findings           # a full scan of the DiGraph: the same findings
    assert held_bytes(g) == report.saved_bytes
    assert g.graph["roots"] and all(g.nodes[r]["root"] for r in g.graph["roots"])
    assert sum(d["root"] for _, d in g.nodes(data=True)) == len(set(g.graph["roots"]))
    assert nx.is_directed_acyclic_graph(g)


def _readers_agree(root, params) -> None:
    roots, names = flatten_roots(root), param_names(None, params)
    fast, general = build(roots, names).digraph(), build(roots, names, fast=False).digraph()
    assert list(fast.nodes(data=True)) == list(general.nodes(data=True))
    assert list(fast.edges(data=True)) == list(general.edges(data=True))
    assert fast.graph == general.graph


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_compact_form_and_digraph_agree(name):
    _compact_agrees(*GRAPHS[name]())


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_fast_path_and_general_reader_agree(name):
    _readers_agree(*GRAPHS[name]())


def _program_root(prog):
    run = run_program(prog)
    return run.root, run.params


@_FUZZ
@given(programs)
def test_compact_form_and_digraph_agree_on_random_programs(prog):
    try:
        root, params = _program_root(prog)
        _compact_agrees(root, params)
    except gradscope.NoGradRootError:
        pass


@_FUZZ
@given(programs)
def test_fast_path_and_general_reader_agree_on_random_programs(prog):
    try:
        _readers_agree(*_program_root(prog))
    except gradscope.NoGradRootError:
        pass


def test_traced_report_agrees_and_keeps_module_names():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    with gradscope.trace() as tr:
        loss = model(torch.randn(2, 3)).sum()
    report = gradscope.inspect(loss, model=model, trace=tr)
    text = report.summary()
    g = report.graph
    assert report.summary() == text
    mods = {d["name"]: d["module"] for _, d in g.nodes(data=True) if d["kind"] == "op"}
    assert mods["AddmmBackward0"] in ("0", "2") and mods["TanhBackward0"] == "1"
    assert "Saved memory by module" in text


def test_report_graph_is_exactly_the_contract():
    root, params = GRAPHS["mlp"]()
    g = gradscope.inspect(root, params=params).graph
    addmm = next(d for _, d in g.nodes(data=True) if d["name"] == "AddmmBackward0")
    assert list(addmm) == ["kind", "name", "saved", "saved_bytes", "device", "module", "root", "opaque", "seq",
                           "attrs", "out_shapes", "out_dtypes"]
    assert list(addmm["saved"][0]) == ["slot", "shape", "dtype", "device", "nbytes", "status", "storage"]
    assert type(addmm["attrs"]["mat1_sym_sizes"]) is list and type(addmm["out_shapes"][0]) is list
    leaf = next(d for _, d in g.nodes(data=True) if d["kind"] == "param")
    assert list(leaf) == ["kind", "name", "saved", "saved_bytes", "module", "root", "opaque", "seq", "shape",
                          "dtype", "requires_grad", "device", "grad"]
    assert addmm["out_dtypes"] == ["float32"] and leaf["grad"] is False   # no .grad before backward
    scalars = [e for _, d in g.nodes(data=True) for e in d["saved"] if e.get("scalar")]
    assert scalars and all(e["shape"] == [] and e["status"] == "live" for e in scalars)   # x * 2, / 4.0
