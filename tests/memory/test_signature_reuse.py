"""Graphs of one structure share what the in-node signatures and gradient layouts derive from it
(memory/kernels/reuse.py NOTE [signature reuse]): a second inspection of the same model predicts what a
fresh computation predicts, a graph that differs in a shape, a stride or an edge gets its own, and nothing
kept refers to a tensor. The numbers themselves are checked against torch.profiler in
test_backward_memory.py and test_innode.py."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import gradscope
from gradscope.memory.kernels import reuse
from gradscope.memory.kernels.reuse import derived
from gradscope.memory.replay.backward import program
from tests._memmodels import MODELS


def _fields(bm):
    return (bm.order, bm.levels, bm.inner, bm.peak, bm.peak_node, bm.end, bm.base, bm.absolute_peak,
            bm.workspace, bm.unmodelled, bm.innode_unknown)


@pytest.mark.parametrize("name", ["transformer_encoder", "convnext", "gru", "checkpoint_nonreentrant"])
def test_same_structure_shares_and_predicts_what_a_fresh_computation_does(name):
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS[name]()
    loss = loss_fn(model, *inputs)
    opt = torch.optim.AdamW(model.parameters())
    reuse._LAST.clear()
    first = gradscope.inspect(loss, model=model)
    fresh = first.backward_memory(optimizer=opt)
    second = gradscope.inspect(loss, model=model)
    reused = second.backward_memory(optimizer=opt)
    assert derived(program(second)) is derived(program(first))  # shared, not made again
    assert program(second).edges is program(first).edges  # the program's structural part too
    assert program(second).storages is not program(first).storages  # what each walk reads afresh
    assert _fields(reused) == _fields(fresh)
    reuse._LAST.clear()
    third = gradscope.inspect(loss, model=model)
    assert _fields(third.backward_memory(optimizer=opt)) == _fields(fresh)  # made again: the same
    assert derived(program(third)) is not derived(program(first))


def _net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))


def _inspected(model, x):
    return gradscope.inspect(model(x).flatten(2).transpose(1, 2).pow(2).mean(), model=model)


@pytest.mark.parametrize("change", ["batch", "channels_last", "dtype"])
def test_another_shape_stride_or_dtype_is_not_shared(change):
    torch.manual_seed(0)
    model = _net()
    x = torch.randn(2, 3, 8, 8)
    base = _inspected(model, x)
    base_bm = base.backward_memory()
    if change == "batch":
        y = torch.randn(3, 3, 8, 8)
    elif change == "channels_last":
        y = x.contiguous(memory_format=torch.channels_last)
    else:
        model, y = model.double(), x.double()
    other = _inspected(model, y)
    bm = other.backward_memory()
    assert derived(program(other)) is not derived(program(base))
    reuse._LAST.clear()
    again = _inspected(model, y)
    assert _fields(again.backward_memory()) == _fields(bm)  # what it predicted is what a fresh one predicts
    if change != "channels_last":
        assert bm.peak != base_bm.peak


def test_nothing_kept_refers_to_a_tensor_or_a_module():
    torch.manual_seed(0)
    model = _net()
    x = torch.randn(2, 3, 8, 8)
    report = _inspected(model, x)
    report.backward_memory()
    assert reuse._LAST  # the structure is kept
    refs = [weakref.ref(model), weakref.ref(x), *(weakref.ref(p) for p in model.parameters())]
    del model, x, report
    gc.collect()
    assert all(r() is None for r in refs)
    stack, seen = [reuse._LAST], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        assert not isinstance(obj, (torch.Tensor, nn.Module)), type(obj)
        if isinstance(obj, (list, tuple, dict, set, frozenset)):
            stack.extend(gc.get_referents(obj))


def test_a_value_equal_but_of_another_type_is_not_shared():
    torch.manual_seed(0)
    x = torch.randn(4, 4, requires_grad=True)
    as_int = gradscope.inspect(x.pow(3).sum())
    as_int.backward_memory()
    as_float = gradscope.inspect(x.pow(3.0).sum())  # 3 == 3.0, but the signature's JSON tells them apart
    as_float.backward_memory()
    assert derived(program(as_float)) is not derived(program(as_int))
    again = gradscope.inspect(x.pow(3.0).sum())
    again.backward_memory()
    assert derived(program(again)) is derived(program(as_float))
