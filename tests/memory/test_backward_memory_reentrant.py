"""Reentrant checkpoint (``use_reentrant=True``): the nested backward, modelled from the region's layers,
against torch.profiler (docs/internals.md#reentrant-checkpoint and #engine-order; memory/replay/reentrant.py
NOTE [reentrant checkpoint backward]).

Which variant is modelled: a region whose function is an ``nn.Sequential`` (nested ones too) of
``Linear``/``ReLU``/``GELU``/``SiLU``/``Tanh``/``Sigmoid``/``Identity`` with torch's own forward. A region
with its own ``forward`` (a residual inside the block) has no recorded ops: the outer node then only
allocates its parameters' gradients, and the peak is a lower bound (said in ``bm.unmodelled``), unless the
forward ran under ``gradscope.trace()`` (tests/memory/test_backward_memory_reentrant_traced.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import gradscope
from gradscope.memory.replay.backward import program
from gradscope.memory.replay.reentrant import modelled_region, node_effect
from gradscope.memory.replay.simulate import simulate
from tests._memmodels import MODELS, ReentrantStack
from tests._memtruth import measure


def _truth(model, inputs, loss_fn):
    gradscope.inspect(loss_fn(model, *inputs), model=model).backward_memory()
    return measure(lambda: (loss_fn(model, *inputs), model), before=inputs,
                   inspect=lambda loss, m: gradscope.inspect(loss, model=m),
                   predict=lambda r, _: r.backward_memory())


def _nested_names(report, bm) -> list:
    prog = program(report)
    out = []
    for nid in bm.order:
        v = prog.index[nid]
        rec = modelled_region(prog.attrs[v].get("attrs") or {})       # known layers, or traced
        if rec is not None:
            out.extend(node_effect(prog, v, rec, simulate).names)
    return out


@pytest.mark.parametrize("name", ["checkpoint_reentrant", "checkpoint_reentrant_chain"])
@pytest.mark.parametrize("grad_set", [False, True], ids=["nograd", "grad"])
def test_nested_backward_matches_the_profiler(name, grad_set):
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS[name]()
    if grad_set:
        loss_fn(model, *inputs).backward()
    truth = _truth(model, inputs, loss_fn)
    bm = truth.prediction
    ckpt = [i for i, n in enumerate(bm.names) if n == "CheckpointFunctionBackward"]
    nodes = truth.report.graph.nodes
    assert ckpt and all(nodes[bm.order[i]]["attrs"]["region_recompute"]["layers"] for i in ckpt)
    assert _nested_names(truth.report, bm) == truth.nested    # the nested engine's order, node by node
    for i in ckpt:                                            # inside each checkpoint node: its highest point
        assert abs(bm.inner[i] - truth.inner[i]) <= 4096, (i, bm.inner[i], truth.inner[i])
    assert max(abs(a - b) for a, b in zip(bm.levels, truth.levels)) <= 4096
    assert abs(bm.peak - truth.peak) <= 0.01 * truth.peak
    rows = bm.contributors()  # the rows sum to the peak, the nested backward's part included
    assert abs(sum(b for _, _, b in rows) - bm.peak) <= 4, (rows, bm.peak)


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))

    def forward(self, x):
        return x + self.mlp(x)


def _residual_inside():
    """Two residual blocks (a ``forward`` of their own), each in a reentrant checkpoint, then a head."""
    return ReentrantStack([_Residual() for _ in range(2)], nn.Linear(64, 1))


def test_custom_forward_region_is_modelled_when_traced():
    # untraced, the region's ops are not known before backward (the next test); traced, its recorded calls
    # are replayed on meta (memory/replay/traced.py; more cases in test_backward_memory_reentrant_traced.py)
    torch.manual_seed(0)
    model, x = _residual_inside(), torch.randn(16, 64, requires_grad=True)
    loss_fn = lambda m, x: m(x).pow(2).mean()  # noqa: E731

    def forward():
        with gradscope.trace(model) as tr:
            loss = loss_fn(model, x)
        forward.tr = tr
        return loss, model

    truth = measure(forward, before=(x,), inspect=lambda loss, m: gradscope.inspect(loss, model=m, trace=forward.tr),
                    predict=lambda r, _: r.backward_memory())
    bm = truth.prediction
    nodes = truth.report.graph.nodes
    attrs = [nodes[n]["attrs"] for n, k in zip(bm.order, bm.names) if k == "CheckpointFunctionBackward"]
    assert len(attrs) == 2 and all(a["region_recompute"]["layers"] is None for a in attrs)
    assert bm.unmodelled == [] and "lower bound" not in str(bm)
    assert max(abs(a - b) for a, b in zip(bm.levels, truth.levels)) <= 4096
    assert abs(bm.peak - truth.peak) <= 0.01 * truth.peak


def test_an_unmodelled_region_is_said_and_the_peak_is_a_lower_bound():
    torch.manual_seed(0)
    model, x = _residual_inside(), torch.randn(16, 64, requires_grad=True)
    truth = _truth(model, (x,), lambda m, x: m(x).pow(2).mean())
    bm = truth.prediction
    regions = [n for n, k in zip(bm.order, bm.names) if k == "CheckpointFunctionBackward"]
    assert len(regions) == 2 and sorted(bm.unmodelled) == sorted(regions)
    assert truth.peak > bm.peak                   # the profiler: really above the prediction
    text = str(bm)
    assert "2 reentrant checkpoint regions" in text and "lower bounds" in text and "use_reentrant=False" in text
    torch.manual_seed(0)
    modelled, inputs, loss_fn = MODELS["checkpoint_reentrant"]()
    bm = gradscope.inspect(loss_fn(modelled, *inputs), model=modelled).backward_memory()
    assert bm.unmodelled == [] and "lower bound" not in str(bm)


def test_layers_outside_the_model_are_not_guessed():
    from gradscope.walk.checkpoint import region_layers

    assert region_layers(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))) is None     # RNG-dependent masks
    assert region_layers(nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))) is None
    assert region_layers(_Residual()) is None
    hooked = nn.Sequential(nn.Linear(4, 4))
    hooked.register_forward_hook(lambda m, i, o: o * 2)
    assert region_layers(hooked) is None
    layers = region_layers(nn.Sequential(nn.Linear(4, 3, bias=False), nn.Dropout(0.1).eval(), nn.Tanh()))
    assert layers == [["linear", 4, 3, "float32", False, True, False, False, False], ["TanhBackward0"]]


def test_modelling_runs_and_allocates_nothing():
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS["checkpoint_reentrant_chain"]()
    loss = loss_fn(model, *inputs)
    calls = []
    for b in model.blocks:
        b.register_forward_pre_hook(lambda m, a: calls.append(m))
    report = gradscope.inspect(loss, model=model)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        bm = report.backward_memory()
    assert [e for e in prof.events() if getattr(e, "cpu_memory_usage", 0) > 0] == []
    assert calls == [] and bm.peak > 0           # no region was re-run to find its ops


@pytest.mark.parametrize("name", ["checkpoint_reentrant", "checkpoint_reentrant_chain"])
def test_step_budget_counts_the_rng_states_the_ctx_keeps(name):
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS[name]()
    opt = torch.optim.AdamW(model.parameters())
    gradscope.inspect(loss_fn(model, *inputs), model=model).backward_memory(optimizer=opt)
    truth = measure(lambda: (loss_fn(model, *inputs), model), before=inputs, optimizer=opt,
                    inspect=lambda loss, m: gradscope.inspect(loss, model=m),
                    predict=lambda r, o: r.backward_memory(optimizer=o))
    bm = truth.prediction
    # the input that requires grad and that the region's first op saves is one storage, counted once
    # (graph["input_storages"]): the step's peak is exact, not 4 KiB over
    assert abs(bm.absolute_peak - truth.absolute_peak) <= 1024, (bm.absolute_peak, truth.absolute_peak)
    assert abs((bm.end + bm.step.end) - truth.step_end) <= 4096
