"""The replay compiled from inspect()'s compact records equals the one compiled from the DiGraph, and builds
neither the DiGraph nor the node dicts it does not need (memory/replay/compile.py NOTE [compiling from the
compact records]). The numbers themselves are checked against torch.profiler in test_backward_memory.py."""

from __future__ import annotations

import copy

import pytest
import torch

import gradscope
from gradscope.memory.replay.backward import program
from gradscope.memory.replay.engine import compile_graph
from tests._memmodels import MODELS

FIELDS = ("ids", "name", "seq", "leaf", "grad_bytes", "grad_shapes", "saved", "storages", "shapes", "external",
          "has_grad", "roots", "root_bytes", "opaque", "regions", "recompute")


@pytest.mark.parametrize("name", ["mlp", "gru", "weight_sharing", "custom_function", "checkpoint_reentrant",
                                  "glu_split", "gpt_sdpa", "checkpoint_nonreentrant"])
def test_compact_program_equals_the_digraph_one(name):
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS[name]()
    loss = loss_fn(model, *inputs)
    fast = gradscope.inspect(loss, model=model)
    a = program(fast)
    bm_fast = fast.backward_memory()
    assert fast._graph is None                                   # no DiGraph was built
    records = fast.peek_graph().compact
    slow = gradscope.inspect(loss, model=model)
    b = compile_graph(slow.graph)
    for f in FIELDS:
        assert getattr(a, f) == getattr(b, f), f
    assert [list(e) for e in a.edges] == [list(e) for e in b.edges]
    assert [list(p) for p in a.needs] == [list(p) for p in b.needs]
    bm_slow = slow.backward_memory()
    assert (bm_fast.order, bm_fast.levels, bm_fast.inner, bm_fast.peak, bm_fast.end, bm_fast.base) == \
        (bm_slow.order, bm_slow.levels, bm_slow.inner, bm_slow.peak, bm_slow.end, bm_slow.base)
    made = len(records._dicts)
    assert made < len(records)                                   # node dicts only where something read them
    assert list(bm_fast.modules) == list(bm_slow.modules) == list(a.module[a.index[n]] for n in bm_fast.order)


def test_program_is_cached_and_survives_the_digraph_being_built():
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS["mlp"]()
    report = gradscope.inspect(loss_fn(model, *inputs), model=model)
    first = program(report)
    assert program(report) is first
    _ = report.graph                                             # the DiGraph, built from the same records
    assert program(report) is first
    report.graph = report.graph.copy()                           # a different graph: compiled again
    assert program(report) is not first


DEFERRED = ("base", "absolute_peak", "parts", "workspace", "names", "unmodelled")


@pytest.mark.parametrize("name", list(MODELS))
def test_deferred_fields_equal_a_direct_computation(name):
    """backward_memory() fills base, absolute_peak, parts, workspace, names and unmodelled on first access
    (backward.py NOTE [deferred fields]): the values are those computed from the graph directly, whichever
    field is read first, and the same as on a report whose DiGraph was built."""
    from gradscope.memory.kernels.workspace import innode
    from gradscope.memory.replay.accounting import step_base
    from gradscope.memory.replay.gradients import VIEW_OPS

    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS[name]()
    loss = loss_fn(model, *inputs)
    report = gradscope.inspect(loss, model=model)
    prog = program(report)
    parts = step_base(prog, report.peek_graph(), prog.storages, frozenset(), prog.has_grad, None)
    ops = [i for i in range(len(prog.ids)) if not prog.leaf[i] and prog.name[i] not in VIEW_OPS]
    ws = {prog.ids[i]: w for i, w in innode(prog, ops).bytes.items()}
    direct = {"base": sum(parts.values()), "parts": parts, "workspace": ws,
              "names": [prog.name[prog.index[n]] for n in report.backward_memory().order]}
    direct["absolute_peak"] = direct["base"] + report.backward_memory().peak
    for first in DEFERRED:
        bm = report.backward_memory()
        assert "base" not in vars(bm)                            # not computed at call time
        getattr(bm, first)
        for f, want in direct.items():
            assert getattr(bm, f) == want, (first, f)
    slow = gradscope.inspect(loss, model=model)
    _ = slow.graph
    bm, other = report.backward_memory(), slow.backward_memory()
    assert bm == other and repr(bm) == repr(other)               # dataclass equality reads every field
    assert [f for f in DEFERRED if getattr(bm, f) != getattr(other, f)] == []
    assert not hasattr(bm, "no_such_field")


def test_a_deferred_field_can_be_changed_like_any_other():
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS["mlp"]()
    bm = gradscope.inspect(loss_fn(model, *inputs), model=model).backward_memory()
    base = gradscope.inspect(loss_fn(model, *inputs), model=model).backward_memory().base
    bm.base += 100                                               # what what_if does to a batch-grown loss
    bm.parts["loss"] += 100
    assert bm.base == base + 100 and bm.parts["loss"] == bm.parts["loss"]
    copied = copy.copy(bm)
    assert copied.base == base + 100 and copied == bm


def test_engine_order_with_a_node_the_roots_do_not_reach():
    """The engine counts dependencies from the roots: a node they do not reach must not hold back the node
    it sends a gradient to (the engine never sees it)."""
    from gradscope.memory.replay.engine import engine_order

    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS["glu_split"]()
    report = gradscope.inspect(loss_fn(model, *inputs), model=model)
    graph = report.graph.copy()
    want = engine_order(compile_graph(graph))
    roots = graph.graph["roots"]
    target = next(n for n, d in graph.nodes(data=True) if d.get("kind") == "op" and graph.pred[n] and n not in roots)
    graph.add_node("stray", **{**graph.nodes[target], "seq": 10**6})
    graph.add_edge(target, "stray", index=0, output=0)           # the stray node sends the target a gradient
    prog = compile_graph(graph)
    assert (prog.index[target], 0) in prog.edges[prog.index["stray"]]
    got = engine_order(prog)
    ids = list(report.graph.nodes)
    assert [prog.ids[v] for v in got] == [ids[v] for v in want] and len(got) == len(ids)
    assert prog.index["stray"] not in got


def test_numel_bytes_converts_each_dimension():
    from gradscope.memory.replay.dtypes import numel_bytes

    assert numel_bytes(torch.Size([2, 3]), "float16") == 12
    assert numel_bytes([2.0, 3], "float32") == numel_bytes(["2", 3], None) == 24      # as int() reads them
    assert numel_bytes([], "int64") == numel_bytes(None, "int64") == 8
    with pytest.raises((TypeError, ValueError)):
        numel_bytes(["x", 3], "float32")
