"""Cuts whose place is not the op that made the tensor: copies into new leaves, ``detach_()`` in place,
forward hooks returning a detached output (and hooks with two detaches), whole regions under
``inference_mode``; and parameters that are simply not used by this forward, which no earlier no_grad op
cut. Each program runs plain and traced; torch is the judge (``.grad`` is None after ``backward()`` for
exactly the flagged parameters), and each has a healthy twin that must come out clean.
"""

from __future__ import annotations

import dataclasses
import inspect as pyinspect
import os
import threading
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradscope
from tests.conftest import grads_none


def _line(obj, marker: str) -> str:
    """``file.py:N`` of the one line of ``obj``'s source ending in ``# marker``."""
    lines, start = pyinspect.getsourcelines(obj)
    hits = [start + i for i, t in enumerate(lines) if t.rstrip().endswith("# " + marker)]
    assert len(hits) == 1, (marker, hits)
    return f"{os.path.basename(pyinspect.getsourcefile(obj))}:{hits[0]}"


def _judge(make, x=None):
    """(traced report, plain report, torch's parameters with .grad None) of one program, run twice."""
    torch.manual_seed(0)
    x = torch.randn(3, 4) if x is None else x
    model = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "To copy construct from a tensor" and friends
        with gradscope.trace(model) as tr:
            loss = model(x)
        traced = gradscope.inspect(loss, model=model, trace=tr)
        plain = gradscope.inspect(model(x), model=model)
    loss.backward()
    return traced, plain, grads_none(model)


def _flagged(report, kinds=("unused-parameter", "detached-branch")) -> set[str]:
    return {p for f in report.findings if f.kind in kinds and f.severity == "error" for p in f.params}


def _assert_cut(make, where: str, *words: str, params=None):
    """Traced: one detached-branch at ``where`` whose message holds ``words``; plain: the same parameters."""
    traced, plain, none = _judge(make)
    assert none, "the program must lose a gradient"
    assert _flagged(traced) == _flagged(plain) == none == (params or none)
    cut = [f for f in traced.findings if f.kind == "detached-branch"]
    assert [f.location for f in cut] == [where], traced.findings
    for w in words:
        assert w in cut[0].message, (w, cut[0].message)
    assert "use that result in the loss" not in cut[0].message.lower()
    return cut[0]


def _assert_clean(make):
    traced, plain, none = _judge(make)
    assert none == set()
    assert [f for f in traced.findings if f.severity == "error"] == []
    assert [f for f in plain.findings if f.severity == "error"] == []


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(4, 1)


# -- copies into new leaves -------------------------------------------------------------------------
class TensorOfValues(_Two):
    def forward(self, x):
        h = self.a(x).mean(0)
        scale = torch.tensor([h[0], h[1]])  # CUT
        return (self.b(x) * scale.sum()).sum()


class NewTensor(_Two):
    def forward(self, x):
        gate = self.a(x).sigmoid().mean()
        gate = x.new_tensor(gate)  # CUT
        return (self.b(x) * gate).sum()


class AsTensorOfValues(_Two):
    def forward(self, x):
        h = self.a(x)
        stats = torch.as_tensor([h.mean(), h.std()])  # CUT
        return (self.b(x) * stats.sum()).sum()


class StackOfValues(_Two):  # the healthy twin of all three
    def forward(self, x):
        h = self.a(x).mean(0)
        return (self.b(x) * torch.stack([h[0], h[1]]).sum()).sum()


@pytest.mark.parametrize(
    "cls,words",
    [
        (TensorOfValues, ("torch.tensor()", "torch.stack()")),
        (NewTensor, ("new_tensor()", "the tensor itself")),
        (AsTensorOfValues, ("torch.as_tensor()", "torch.stack()")),
    ],
    ids=["tensor", "new_tensor", "as_tensor"],
)
def test_a_copy_into_a_new_tensor_is_the_cut(cls, words):
    cut = _assert_cut(
        cls,
        _line(cls.forward, "CUT"),
        *words,
        "new leaf" if cls is not AsTensorOfValues else "graph",
        params={"a.weight", "a.bias"},
    )
    assert cut.params == ("a.weight", "a.bias")


def test_the_stacked_twin_is_clean():
    _assert_clean(StackOfValues)


class ParameterOfOutput(_Two):
    def forward(self, x):
        scale = nn.Parameter(self.a(x).mean(0))  # CUT
        return (self.b(x) * scale.sum()).sum()


class ParameterOfClone(_Two):
    def forward(self, x):
        w = torch.nn.Parameter(self.a.weight.clone())  # CUT
        return (self.b(x) + torch.nn.functional.linear(x, w, self.a.bias).sum()).sum()


class CloneOfWeight(_Two):  # the healthy twin: the clone itself, no new Parameter
    def forward(self, x):
        w = self.a.weight.clone()
        return (self.b(x) + torch.nn.functional.linear(x, w, self.a.bias).sum()).sum()


@pytest.mark.parametrize(
    "cls,params", [(ParameterOfOutput, {"a.weight", "a.bias"}), (ParameterOfClone, {"a.weight"})],
    ids=["computed", "clone"],
)
def test_a_parameter_made_in_forward_is_the_cut(cls, params):
    cut = _assert_cut(cls, _line(cls.forward, "CUT"), "nn.Parameter()", "new leaf", "__init__", params=params)
    assert set(cut.params) == params


def test_the_clone_without_a_parameter_is_clean():
    _assert_clean(CloneOfWeight)


def test_a_parameter_made_outside_the_trace_is_not_recorded():
    # the wrapper is gone once the trace exits, and torch's own __new__ is back
    new = nn.Parameter.__dict__["__new__"]
    _judge(ParameterOfOutput)
    assert nn.Parameter.__dict__["__new__"] is new
    with gradscope.trace() as tr:
        pass
    nn.Parameter(torch.randn(2, requires_grad=True) * 2)
    assert tr.events == []


def test_a_parameter_made_on_another_thread_is_not_recorded_and_nested_traces_both_see_one():
    t = torch.randn(2, requires_grad=True)
    with gradscope.trace() as outer:
        other = threading.Thread(target=lambda: nn.Parameter(t * 2))
        other.start()
        other.join()
        assert outer.events == []
        with gradscope.trace() as inner:
            nn.Parameter(t * 3)
    assert [e["op"] for e in inner.events] == [e["op"] for e in outer.events] == ["Parameter"]
    assert nn.Parameter.__dict__["__new__"].__func__.__module__ == "torch.nn.parameter"


# -- detach_() in place -----------------------------------------------------------------------------
class CaptureInPlace(_Two):
    def forward(self, x):
        h = self.a(x)
        self.feat = h
        self.feat.detach_()  # CUT
        return (self.b(x) * h.sum()).sum()


def _log_norm(t, log):
    t.detach_()  # CUT
    log.append(float(t.norm()))
    return t


class LogInPlace(_Two):
    def forward(self, x):
        self.log = []
        h = _log_norm(self.a(x), self.log)
        return (self.b(x) + h.sum()).sum()


class CaptureCopy(_Two):  # the healthy twin: detach a copy for the record
    def forward(self, x):
        h = self.a(x)
        self.feat = h.detach()
        return (self.b(x) * h.sum()).sum()


@pytest.mark.parametrize(
    "cls,where", [(CaptureInPlace, CaptureInPlace.forward), (LogInPlace, _log_norm)], ids=["attribute", "logging"]
)
def test_detach_in_place_is_located_at_its_own_line(cls, where):
    _assert_cut(cls, _line(where, "CUT"), ".detach_()", "in place")


def test_detaching_a_copy_is_clean():
    _assert_clean(CaptureCopy)


# -- forward hooks that return a detached output -----------------------------------------------------
class HookReturnsDetached(_Two):
    def __init__(self):
        super().__init__()
        self.a.register_forward_hook(_detaching_hook)

    def forward(self, x):
        return (self.b(x) * self.a(x).sum()).sum()


def _detaching_hook(module, args, out):
    return out.detach()  # CUT


class FeatureCapture:
    """A feature-capture utility: keeps the output and (wrongly) returns the detached copy."""

    def __init__(self):
        self.features = None

    def __call__(self, module, args, out):
        self.features = out.detach()  # CUT
        return self.features


class CapturedEncoder(nn.Module):
    def __init__(self, returns=True):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        self.head = nn.Linear(4, 1)
        self.capture = FeatureCapture()
        hook = self.capture if returns else (lambda m, a, o: (self.capture(m, a, o), None)[1])
        self.encoder[0].register_forward_hook(hook)

    def forward(self, x):
        return self.head(self.encoder(x)).sum()


class TwoDetaches(_Two):
    def __init__(self, returns_first: bool):
        super().__init__()
        self.store = {}
        self.returns_first = returns_first
        self.a.register_forward_hook(self.hook)

    def hook(self, module, args, out):
        first = out.detach()  # FIRST
        self.store["feat"] = out.detach()  # SECOND
        return first if self.returns_first else self.store["feat"]

    def forward(self, x):
        return (self.b(x) * self.a(x).sum()).sum()


def test_a_hook_returning_a_detached_output_is_named_with_its_module():
    cut = _assert_cut(HookReturnsDetached, _line(_detaching_hook, "CUT"), "forward hook _detaching_hook", "of module a")
    assert "hook return None" in cut.message


def test_a_capture_utility_hook_is_named_with_its_module():
    cut = _assert_cut(
        CapturedEncoder, _line(FeatureCapture.__call__, "CUT"), "forward hook FeatureCapture", "of module encoder.0"
    )
    assert set(cut.params) == {"encoder.0.weight", "encoder.0.bias"}


def test_a_hook_that_returns_none_is_clean():
    _assert_clean(lambda: CapturedEncoder(returns=False))


def _logging_hook(module, args, out):
    module.last_norm = float(out.detach().norm())  # logged: a detach the path does not cross
    return out.detach()  # CUT


class LoggedEncoder(CapturedEncoder):
    def __init__(self):
        super().__init__(returns=False)
        self.encoder[2].register_forward_hook(_logging_hook)


def test_a_logging_hook_with_two_detaches_blames_the_returned_one():
    cut = _assert_cut(LoggedEncoder, _line(_logging_hook, "CUT"), "forward hook _logging_hook", "of module encoder.2")
    assert cut.params and all(p.startswith("encoder.") for p in cut.params)


def test_a_hook_with_two_detaches_that_returns_the_output_is_clean():
    class KeepsBoth(TwoDetaches):
        def hook(self, module, args, out):
            super().hook(module, args, out)
            return out

    _assert_clean(lambda: KeepsBoth(True))


@pytest.mark.parametrize("first", [True, False], ids=["returns-first", "returns-second"])
def test_of_two_detaches_in_a_hook_the_one_the_path_crossed_is_blamed(first):
    where = _line(TwoDetaches.hook, "FIRST" if first else "SECOND")
    _assert_cut(lambda: TwoDetaches(first), where, "forward hook hook")


# -- whole regions under inference_mode -------------------------------------------------------------
class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x):
        return self.body(x)

    @torch.inference_mode()
    def features(self, x):
        return self(x)


class DecoratedBackbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        feats = self.backbone.features(x).clone()  # REGION
        return self.head(feats).sum()


class WithBackbone(DecoratedBackbone):
    def forward(self, x):
        with torch.inference_mode():  # REGION
            feats = self.backbone(x)
            feats = feats / feats.norm()
        return self.head(feats.clone()).sum()


class FrozenWithBackbone(WithBackbone):  # the healthy twin: a frozen backbone
    def __init__(self):
        super().__init__()
        self.backbone.requires_grad_(False)


@pytest.mark.parametrize("cls", [DecoratedBackbone, WithBackbone], ids=["decorator", "with"])
def test_an_inference_mode_region_is_located_at_the_region(cls):
    cut = _assert_cut(cls, _line(cls.forward, "REGION"), "torch.inference_mode()", ".clone()")
    assert {p.split(".")[0] for p in cut.params} == {"backbone"} and len(cut.params) == 4
    assert "outside torch.inference_mode()" in cut.message


class FrozenDecoratedBackbone(DecoratedBackbone):  # the decorator's twin: frozen too
    def __init__(self):
        super().__init__()
        self.backbone.requires_grad_(False)


@pytest.mark.parametrize("cls", [FrozenDecoratedBackbone, FrozenWithBackbone], ids=["decorator", "with"])
def test_a_frozen_backbone_under_inference_mode_is_clean(cls):
    _assert_clean(cls)


# -- unused is not cut -------------------------------------------------------------------------------
class LoRA(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.lora_a = nn.Linear(4, 2, bias=False)
        self.lora_b = nn.Linear(2, 4, bias=False)
        self.merged = False
        self.head = nn.Linear(4, 1)

    def merge(self):
        with torch.no_grad():
            merged = self.base.weight + self.lora_b.weight @ self.lora_a.weight
            self.base.weight.copy_(merged)
        self.merged = True

    def forward(self, x):
        if not self.merged:
            self.merge()
        h = self.base(x)
        if not self.merged:  # skipped after the merge
            h = h + self.lora_b(self.lora_a(x))
        return self.head(h).sum()


class BranchOff(_Two):
    def __init__(self):
        super().__init__()
        self.use_a = False
        self.stats = []

    def forward(self, x):
        with torch.no_grad():
            self.stats.append(self.a.weight.abs().mean())  # logged: the branch is off
        out = self.b(x)
        if self.use_a:
            out = out + self.a(x)[:, :1]
        return out.sum()


@pytest.mark.parametrize("cls,skipped", [(LoRA, "lora_a"), (BranchOff, "a")], ids=["merged-adapter", "branch-off"])
def test_parameters_not_used_by_this_forward_are_not_blamed_on_a_no_grad_op(cls, skipped):
    traced, plain, none = _judge(cls)
    assert _flagged(traced) == _flagged(plain) == none
    errors = [f for f in traced.findings if f.severity == "error"]
    assert {f.kind for f in errors} == {"unused-parameter"}
    assert all(f.location is None and "not used by this forward" in f.message for f in errors)
    assert any(f"module {skipped} " in f.message for f in errors)
    assert all("the forward of the root module ran and skipped it" in f.message for f in errors)
    assert not any("no_grad" in f.message for f in errors)
    param = sorted(none)[0]
    assert "not used by this forward" in traced.explain(param) and "skipped it" in traced.explain(param)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.adapter, self.use_adapter = nn.Linear(4, 4), nn.Linear(4, 4), False

    def forward(self, x):
        h = self.body(x)
        return h + self.adapter(h) if self.use_adapter else h


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.blocks[0].use_adapter = True  # the second block's adapter is off

    def forward(self, x):
        return self.blocks(x).sum()


def test_a_skipped_module_names_the_module_whose_forward_skipped_it():
    traced, plain, none = _judge(Stack)
    assert none == _flagged(traced) == _flagged(plain) == {"blocks.1.adapter.weight", "blocks.1.adapter.bias"}
    (f,) = [f for f in traced.findings if f.severity == "error"]
    assert "module blocks.1.adapter was never called" in f.message
    assert "the forward of module blocks.1 ran and skipped it" in f.message
    assert "the forward of module blocks.1 ran and skipped it" in traced.explain("blocks.1.adapter.weight")


def test_the_adapter_before_its_merge_is_clean():
    class Unmerged(LoRA):
        def merge(self):  # merging switched off: the adapter runs on every forward
            pass

    _assert_clean(Unmerged)


def test_a_no_grad_op_that_feeds_the_loss_is_still_the_cut():
    class Gate(_Two):
        def forward(self, x):
            with torch.no_grad():
                scale = self.a.weight.abs().mean()  # CUT
            return (self.b(x) * scale).sum()

    # a.weight was used directly (module a never called), and its no_grad result feeds the loss
    cut = _assert_cut(Gate, _line(Gate.forward, "CUT"), "torch.no_grad()", params={"a.weight", "a.bias"})
    assert cut.params == ("a.weight",)


# -- outputs a custom Function returns without a gradient -------------------------------------------
class SplitMarked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mark):
        kept, scaled = x * 2, x * 3
        if mark:
            ctx.mark_non_differentiable(scaled)
        return kept, scaled

    @staticmethod
    def backward(ctx, g_kept, g_scaled):
        g = g_kept * 2
        return (g if g_scaled is None else g + g_scaled * 3), None


class GateMarked(torch.autograd.Function):
    """One output, marked: a soft gate someone declared constant."""

    @staticmethod
    def forward(ctx, x, mark):
        gate = torch.sigmoid(x).mean(0)
        if mark:
            ctx.mark_non_differentiable(gate)
        ctx.save_for_backward(x)
        return gate

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g.expand_as(x) * s * (1 - s) / x.shape[0], None


class UsesSecond(nn.Module):
    def __init__(self, mark=True):
        super().__init__()
        self.a, self.b, self.mark = nn.Linear(4, 4), nn.Linear(4, 1), mark

    def forward(self, x):
        kept, scaled = SplitMarked.apply(self.a(x), self.mark)  # CUT
        return self.b(scaled).sum() + 0 * x.sum()


class UsesGate(nn.Module):
    def __init__(self, mark=True):
        super().__init__()
        self.a, self.b, self.mark = nn.Linear(4, 4), nn.Linear(4, 4), mark

    def forward(self, x):
        gate = GateMarked.apply(self.a(x), self.mark)  # CUT
        return (self.b(x) * gate).sum()


@pytest.mark.parametrize("cls,fn", [(UsesSecond, "SplitMarked"), (UsesGate, "GateMarked")], ids=["split", "gate"])
def test_a_function_output_marked_non_differentiable_is_the_cut(cls, fn):
    cut = _assert_cut(cls, _line(cls.forward, "CUT"), f"custom autograd.Function {fn}", "mark_non_differentiable",
                      params={"a.weight", "a.bias"})
    assert "return its gradient from backward()" in cut.message


@pytest.mark.parametrize("cls", [UsesSecond, UsesGate], ids=["split", "gate"])
def test_the_same_functions_unmarked_are_clean(cls):
    _assert_clean(lambda: cls(mark=False))


# -- reentrant checkpoint with its tensors inside a container ----------------------------------------
@dataclasses.dataclass
class Pair:
    h: torch.Tensor
    x: torch.Tensor


def _mix(pair):
    h, x = pair
    return torch.tanh(h) * x


def _mix_dc(pair: Pair):
    return torch.tanh(pair.h) * pair.x


def _mix_args(h, x):
    return torch.tanh(h) * x


class TupleCheckpoint(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        mixed = checkpoint(_mix, (h, x), use_reentrant=True)  # CUT
        return (self.b(x) + mixed).sum()


class DataclassCheckpoint(TupleCheckpoint):
    def forward(self, x):
        h = self.a(x)
        mixed = checkpoint(_mix_dc, Pair(h, x), use_reentrant=True)  # CUT
        return (self.b(x) + mixed).sum()


class ArgsCheckpoint(TupleCheckpoint):  # the healthy twin: the tensors as top-level arguments
    def forward(self, x):
        h = self.a(x)
        return (self.b(x) + checkpoint(_mix_args, h, x, use_reentrant=True)).sum()


@pytest.mark.parametrize("cls", [TupleCheckpoint, DataclassCheckpoint], ids=["tuple", "dataclass"])
def test_a_reentrant_checkpoint_does_not_see_tensors_inside_containers(cls):
    cut = _assert_cut(cls, _line(cls.forward, "CUT"), "use_reentrant=True) inside a tuple, list, dict or dataclass",
                      "top-level", params={"a.weight", "a.bias"})
    assert "use_reentrant=False" in cut.message


def test_a_reentrant_checkpoint_with_top_level_tensors_is_clean():
    _assert_clean(ArgsCheckpoint)
