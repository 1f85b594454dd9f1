"""gradscope.trace(): module attribution and cut / in-place locations, against torch's own behaviour.

Ground truth: after ``backward()``, exactly the parameters gradscope flagged have ``.grad is None``;
for in-place hazards ``backward()`` raises. Expected locations come from ``# CUT`` marker comments found
with ``inspect.getsourcelines``, never from hard-coded line numbers.
"""

from __future__ import annotations

import gc
import inspect as pyinspect
import json
import os
import threading
import weakref

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module

import gradscope
from gradscope.errors import InputTypeError, InputValueError
from tests._zoo import Linears
from tests.conftest import grads_none


def _where(obj, marker: str = "CUT") -> str:
    """``file.py:line`` of the line of ``obj``'s source ending in ``# marker`` (as gradscope shows it)."""
    lines, start = pyinspect.getsourcelines(obj)
    hits = [start + i for i, text in enumerate(lines) if text.rstrip().endswith("# " + marker)]
    assert len(hits) == 1, (marker, hits)
    return f"{os.path.basename(pyinspect.getsourcefile(obj))}:{hits[0]}"


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)


class Detach(_Base):
    def forward(self, x):
        h = self.a(x).detach()  # CUT
        return self.b(x) + h


class Data(_Base):
    def forward(self, x):
        h = self.a(x).data  # CUT
        return self.b(x) + h


class NoGrad(_Base):
    def forward(self, x):
        with torch.no_grad():
            h = self.a(x)  # CUT
        return self.b(x) + h


class InferenceMode(_Base):
    def forward(self, x):
        with torch.inference_mode():  # REGION
            h = self.a(x)  # CUT
        return self.b(x) * h.sum().item()


class Item(_Base):
    def forward(self, x):
        scale = self.a(x).sum().item()  # CUT
        return self.b(x) * scale


class ToList(_Base):
    def forward(self, x):
        values = self.a(x).tolist()  # CUT
        return self.b(x) * torch.tensor(values)


class Numpy(_Base):
    def forward(self, x):
        array = self.a(x).detach().cpu().numpy()  # CUT
        return self.b(x) * torch.from_numpy(array)


class Argmax(_Base):
    def forward(self, x):
        index = self.a(x).argmax(-1, keepdim=True)  # CUT
        return self.b(x) * index


class Compare(_Base):
    def forward(self, x):
        mask = self.a(x) > 0  # CUT
        return self.b(x) * mask


class Long(_Base):
    def forward(self, x):
        ints = self.a(x).long()  # CUT
        return self.b(x) + ints


CUTS = [(Detach, "detach", "detach"), (Data, ".data", ".data"), (NoGrad, "no_grad", "linear"),
        (InferenceMode, "no_grad", "linear"), (Item, "to-python", "item"), (ToList, "to-python", "tolist"),
        (Numpy, "to-python", "numpy"), (Argmax, "non-differentiable", "argmax"),
        (Compare, "non-differentiable", "gt"), (Long, "non-differentiable", "long")]


def _traced(model, x=None, trace_model=False):
    x = torch.randn(2, 4) if x is None else x
    with gradscope.trace(model if trace_model else None) as tr:
        loss = model(x).pow(2).sum()
    return loss, tr


@pytest.mark.parametrize("cls,kind,op", CUTS, ids=[c[0].__name__ for c in CUTS])
def test_each_cut_is_located_and_matches_torch(cls, kind, op):
    model = cls()
    loss, tr = _traced(model)
    report = gradscope.inspect(loss, model=model, trace=tr)
    cut = [f for f in report.findings if f.kind == "detached-branch"]
    flagged = {p for f in report.findings if f.kind in ("detached-branch", "unused-parameter")
               for p in f.params}
    assert {p for f in cut for p in f.params} == {"a.weight", "a.bias"}
    # under inference_mode the cut is the region: its `with` line; the op's own line comes with it
    where = _where(cls.forward, "REGION" if cls is InferenceMode else "CUT")
    assert {f.location for f in cut} == {where}
    event = next(e for e in report.graph.graph["events"] if e["kind"] != "inplace")
    assert (event["kind"], event["op"], event["location"]) == (kind, op, where)
    assert event.get("op_location", _where(cls.forward)) == _where(cls.forward)
    assert event["params"] == ["a.bias", "a.weight"]
    json.dumps(report.graph.graph["events"])
    loss.backward()
    assert grads_none(model) == flagged == {"a.weight", "a.bias"}


class SavedOutput(_Base):
    def forward(self, x):
        s = self.a(x).sigmoid()
        s.mul_(2)  # CUT
        return self.b(s)


class SavedInput(_Base):
    def forward(self, x):
        y = x * self.a.weight[0]          # MulBackward0 saves x, which needs no grad
        x.add_(1)  # CUT
        return self.b(y)


class ThroughView(_Base):
    def forward(self, x):
        s = torch.tanh(self.a(x))
        s[:, 0].zero_()  # CUT
        return self.b(s)


class SetItem(_Base):
    def forward(self, x):
        s = self.a(x).exp()
        s[0] = 0.0  # CUT
        return self.b(s)


HAZARDS = [SavedOutput, SavedInput, ThroughView, SetItem]


@pytest.mark.parametrize("cls", HAZARDS, ids=[c.__name__ for c in HAZARDS])
def test_inplace_hazard_gets_the_location_of_the_write(cls):
    model = cls()
    loss, tr = _traced(model)
    report = gradscope.inspect(loss, model=model, trace=tr)
    hazards = [f for f in report.findings if f.kind == "inplace-hazard"]
    assert hazards and {f.location for f in hazards} == {_where(cls.forward)}
    assert _where(cls.forward) in hazards[0].message
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_safe_inplace_is_recorded_but_not_flagged():
    class Safe(_Base):
        def forward(self, x):
            y = self.a(x) * 2                 # MulBackward0 keeps only the scalar
            y.add_(1)  # CUT
            return self.b(y)

    model = Safe()
    loss, tr = _traced(model)
    report = gradscope.inspect(loss, model=model, trace=tr)
    assert [e["location"] for e in report.graph.graph["events"] if e["kind"] == "inplace"] == [
        _where(Safe.forward)]
    assert report.findings == []
    loss.backward()
    assert grads_none(model) == set()


# -- module attribution ----------------------------------------------------------------------------
class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.q(x).softmax(-1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attn()
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(x + self.attn(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.idle = nn.Linear(4, 4)

    def forward(self, x):
        h = self.shared(self.shared(self.blocks(x)))      # one module, called twice
        return self.head(h).tanh()


# (op name, module) in creation order, written by hand from Net's source.
EXPECTED = [
    ("TBackward0", "blocks.0.attn.q"), ("MmBackward0", "blocks.0.attn.q"),
    ("SoftmaxBackward0", "blocks.0.attn"), ("AddBackward0", "blocks.0"),
    ("NativeLayerNormBackward0", "blocks.0.norm"),
    ("TBackward0", "blocks.1.attn.q"), ("MmBackward0", "blocks.1.attn.q"),
    ("SoftmaxBackward0", "blocks.1.attn"), ("AddBackward0", "blocks.1"),
    ("NativeLayerNormBackward0", "blocks.1.norm"),
    ("TBackward0", "shared"), ("AddmmBackward0", "shared"),
    ("TBackward0", "shared"), ("AddmmBackward0", "shared"),
    ("TBackward0", "head"), ("AddmmBackward0", "head"),
    ("TanhBackward0", None),                     # Net's own forward: no submodule
    ("PowBackward0", None), ("SumBackward0", None),   # the loss, outside any module
]


def _ops_in_order(report):
    ops = sorted((d["seq"], d["name"], d["module"]) for _, d in report.graph.nodes(data=True)
                 if d["kind"] == "op")
    return [(name, module) for _, name, module in ops]


@pytest.mark.parametrize("where", ["inspect", "trace", "both"])
def test_module_attribution_on_a_nested_model(where):
    net = Net()
    x = torch.randn(2, 4)
    with torch.no_grad():
        net(x)                                            # an untraced call before: must not leak in
    with gradscope.trace(net if where != "inspect" else None) as tr:
        loss = net(x).pow(2).sum()
    report = gradscope.inspect(loss, model=net if where != "trace" else None, trace=tr)
    assert _ops_in_order(report) == EXPECTED
    called = report.graph.graph["called_modules"]
    assert "idle" not in called and {"shared", "head", "blocks.1.attn.q"} <= set(called)
    if where != "inspect":
        assert tr.calls.count("shared") == 2
    unused = next(f for f in gradscope.inspect(loss, model=net, trace=tr).findings
                  if f.kind == "unused-parameter")
    assert "never called" in unused.message and set(unused.params) == {"idle.weight", "idle.bias"}
    loss.backward()
    assert grads_none(net) == {"idle.weight", "idle.bias"}


def test_modules_outside_the_model_go_to_the_enclosing_module():
    net = Net()
    criterion = nn.MSELoss()                               # a module, but not part of net
    with gradscope.trace() as tr:
        loss = criterion(net(torch.randn(2, 4)), torch.zeros(2, 2))
    report = gradscope.inspect(loss, model=net, trace=tr)
    assert report.graph.nodes[report.graph.graph["roots"][0]]["module"] is None
    assert _ops_in_order(report)[:16] == EXPECTED[:16]


def test_without_any_model_modules_and_params_stay_unnamed():
    net = Detach()
    loss, tr = _traced(net)
    report = gradscope.inspect(loss, trace=tr)
    assert all(d["module"] is None for _, d in report.graph.nodes(data=True))
    assert "called_modules" not in report.graph.graph
    assert [e["params"] for e in report.graph.graph["events"]] == [[]]
    named = gradscope.inspect(loss, params=dict(net.named_parameters()), trace=tr)
    assert named.graph.graph["events"][0]["params"] == ["a.bias", "a.weight"]


# -- hooks, nesting, lifetime ----------------------------------------------------------------------
def _hook_state():
    return (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks),
            len(nn_module._global_forward_hooks_always_called), torch._C._len_torch_function_stack())


class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        self.inner(x)
        raise ValueError("boom in forward")


def test_hooks_removed_after_exit_and_after_exceptions():
    before = _hook_state()
    with gradscope.trace() as tr:
        assert _hook_state() != before
        Net()(torch.randn(2, 4))
    assert _hook_state() == before
    with pytest.raises(ValueError, match="boom in forward"):
        with gradscope.trace():
            Boom()(torch.randn(2, 4))
    assert _hook_state() == before
    with pytest.raises(KeyError):
        with gradscope.trace():
            raise KeyError("outside any module")
    assert _hook_state() == before
    assert "finished" in repr(tr)


def test_forward_that_raises_leaves_later_calls_attributed_correctly():
    net, boom = Net(), Boom()
    with gradscope.trace() as tr:
        with pytest.raises(ValueError):
            boom(torch.randn(2, 4))
        loss = net(torch.randn(2, 4)).pow(2).sum()
    assert _ops_in_order(gradscope.inspect(loss, model=net, trace=tr)) == EXPECTED


def test_nested_traces_each_record_their_own_block():
    model = Detach()
    before = _hook_state()
    x = torch.randn(2, 4)
    with gradscope.trace(model) as outer:
        h = model.a(x).detach()  # OUTER
        with gradscope.trace(model) as inner:
            i = model.b(x).argmax()  # INNER
        loss = (model.b(x) * h * i).sum()
    assert _hook_state() == before
    here = test_nested_traces_each_record_their_own_block
    assert [(e["op"], e["location"]) for e in outer.events] == [
        ("detach", _where(here, "OUTER")), ("argmax", _where(here, "INNER"))]
    assert [(e["op"], e["location"]) for e in inner.events] == [("argmax", _where(here, "INNER"))]
    assert inner.calls == ["b"] and outer.calls == ["a", "b", "b"]
    report = gradscope.inspect(loss, model=model, trace=outer)
    assert {f.location for f in report.findings} == {_where(here, "OUTER")}


def test_repeated_traces_and_reentry():
    model = Detach()
    first = [_traced(model, trace_model=True) for _ in range(2)]
    for loss, tr in first:
        report = gradscope.inspect(loss, model=model, trace=tr)
        assert [e["location"] for e in report.graph.graph["events"]] == [_where(Detach.forward)]
        assert {d["module"] for _, d in report.graph.nodes(data=True) if d["kind"] == "op"} == {"b", None}
    tr = gradscope.trace(model)
    with tr:
        with pytest.raises(InputValueError, match="already recording"):
            tr.__enter__()
        model(torch.randn(2, 4))
    with tr:                                              # a fresh recording
        pass
    assert tr.events == [] and tr.calls == []


def test_trace_keeps_no_tensor_or_module_alive():
    model = Detach()
    x = torch.randn(2, 4)
    with gradscope.trace(model) as tr:
        out = model(x)
        loss = out.pow(2).sum()
    report = gradscope.inspect(loss, model=model, trace=tr)
    refs = [weakref.ref(out), weakref.ref(loss), weakref.ref(model), weakref.ref(model.a.weight)]
    del out, loss, model, report
    gc.collect()
    assert [r() for r in refs] == [None, None, None, None]
    assert len(tr.events) == 1 and tr.events[0]["params"] == []      # names need a live model


def test_other_threads_are_not_recorded():
    net = Net()
    with gradscope.trace(net) as tr:
        t = threading.Thread(target=lambda: Net()(torch.randn(2, 4)))
        t.start()
        t.join()
        loss = net(torch.randn(2, 4)).pow(2).sum()
    assert tr.calls == [None, "blocks", "blocks.0", "blocks.0.attn", "blocks.0.attn.q", "blocks.0.norm",
                        "blocks.1", "blocks.1.attn", "blocks.1.attn.q", "blocks.1.norm", "shared", "shared",
                        "head"]
    assert _ops_in_order(gradscope.inspect(loss, model=net, trace=tr)) == EXPECTED


def test_user_mistakes_are_clear():
    with pytest.raises(InputTypeError, match="takes an nn.Module"):
        gradscope.trace(model=3)
    with gradscope.trace() as tr:
        loss = nn.Linear(2, 1)(torch.randn(1, 2)).sum()
        with pytest.raises(InputValueError, match="after the block ends"):
            gradscope.inspect(loss, trace=tr)
    with pytest.raises(InputValueError, match="never recorded"):
        gradscope.inspect(loss, trace=gradscope.trace())
    other = nn.Linear(2, 1)(torch.randn(1, 2)).sum()
    with pytest.raises(InputValueError, match="another forward pass: none of the 3 autograd nodes"):
        gradscope.inspect(other, trace=tr)


# -- explain ---------------------------------------------------------------------------------------
def test_explain_tells_each_story():
    class Story(Linears):
        LAYERS = {"used": (4, 4), "cut": (4, 4), "never": (4, 4), "dropped": (4, 4), "frozen": (4, 4)}

        def __init__(self):
            super().__init__()
            self.frozen.requires_grad_(False)

        def forward(self, x):
            self.dropped(x)
            return self.used(x) + self.cut(x).detach() + self.frozen(x)  # CUT

    model = Story()
    loss, tr = _traced(model)
    report = gradscope.inspect(loss, model=model, trace=tr)
    assert "reached from the root through used" in report.explain("used.weight")
    text = report.explain("cut.weight")
    assert ".detach()" in text and _where(Story.forward) in text and "cut.bias" in text
    assert "never called" in report.explain("never.weight")
    assert "ran in the forward pass" in report.explain("dropped.weight")
    assert "frozen" in report.explain("frozen.weight")
    loss.backward()
    assert grads_none(model) == {f"{m}.{p}" for m in ("cut", "never", "dropped") for p in ("weight", "bias")}


def test_events_survive_the_json_round_trip(tmp_path):
    model = Detach()
    loss, tr = _traced(model, trace_model=True)
    report = gradscope.inspect(loss, model=model, trace=tr)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report.to_json()))
    loaded = gradscope.load(path)
    assert loaded.graph.graph["events"] == report.graph.graph["events"]
    assert loaded.explain("a.weight") == report.explain("a.weight")
    assert _where(Detach.forward) in loaded.explain("a.weight")


def test_reentrant_checkpoint_is_not_reported_as_a_cut():
    from torch.utils.checkpoint import checkpoint

    class Ckpt(_Base):
        def forward(self, x):
            return checkpoint(self.a, x.requires_grad_(), use_reentrant=True) + self.b(x)

    model = Ckpt()
    loss, tr = _traced(model)
    report = gradscope.inspect(loss, model=model, trace=tr)
    assert report.findings == []        # traced: the parameters the checkpoint body used are known
    untraced = gradscope.inspect(loss, model=model)
    assert [(f.kind, f.severity) for f in untraced.findings] == [("unused-parameter", "warning")]
    assert set(untraced.findings[0].params) == {"a.weight", "a.bias"}     # only those the region may use
    loss.backward()
    assert grads_none(model) == set()


DEEP = """
import gc, sys, time, torch, gradscope
w, v = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
with gradscope.trace() as tr:
    y = w * 1.0
    for _ in range(50_000):
        y = y * 1.0001
    h = y.detach()  # CUT
    loss = (v * h).sum()
report = gradscope.inspect(loss, params={"w": w, "v": v}, trace=tr)
cut = [f for f in report.findings if f.kind == "detached-branch"]
assert [(f.params, f.location) for f in cut] == [(("w",), "<string>:8")], report.findings
del y, h
gc.collect()
time.sleep(0.2)
loss.backward()
assert w.grad is None and v.grad is not None
print("OK")
"""


def test_cut_deep_below_its_parameter_is_found_and_freed_safely():
    # A failure here is a segfault (docs/internals.md#freeing-deep-graphs), so it runs in a subprocess.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", DEEP], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip().endswith("OK")


def test_trace_never_changes_the_program_multi_output_view_of_modified_base():
    # trace() once changed this program: torch refuses grad_fn of an unbind view whose base was written, but
    # .detach()/.data/.numpy() of it run in plain torch, so they must run inside trace() too.
    p = nn.Parameter(torch.randn(4, 4))
    v0, v1, v2, v3 = p.unbind(0)
    with torch.no_grad():
        p[:, 1] = 0.5
    plain = (v1.detach().clone(), v1.data.clone(), v1.detach().numpy().copy())
    with pytest.raises(RuntimeError):   # torch's own truth: the view's grad_fn is refused
        _ = v1.grad_fn
    model = nn.ParameterList([p])
    with gradscope.trace(model) as tr:
        traced = (v1.detach().clone(), v1.data.clone(), v1.detach().numpy().copy())
    assert torch.equal(plain[0], traced[0]) and torch.equal(plain[1], traced[1])
    assert (plain[2] == traced[2]).all()
    assert [e["kind"] for e in tr.events][:2] == ["detach", ".data"]
    assert tr.events[0]["params"] == ["0"]      # the view's parameter, found through its base
