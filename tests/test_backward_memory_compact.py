"""The replay compiled from inspect()'s compact records equals the one compiled from the DiGraph, and builds
neither the DiGraph nor the node dicts it does not need (memory/compact.py NOTE [compiling from the
compact records]). The numbers themselves are checked against torch.profiler in test_backward_memory.py."""

from __future__ import annotations

import pytest
import torch

import gradscope
from gradscope.memory.backward import program
from gradscope.memory.engine import compile_graph
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
    records = fast._view().compact
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
