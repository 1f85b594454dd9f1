"""The ``TorchFunctionMode`` behind :func:`gradscope.trace`: spots graph cuts and in-place writes.

NOTE [cheap per-op path]
The mode sees every torch function call of the forward, so the common case must cost almost nothing:
one dict lookup classifies ``func`` (cached per function object), then the call runs, and an ordinary op
whose output requires grad returns at once. Only when an output does *not* require grad do we scan the
inputs; only when an input requires grad (a real cut) or the op writes in place do we pay for the stack
walk (``sys._getframe``) and the walk to the parameters that fed the cut input. Events hold plain data
(strings, ints, parameter ids); parameters are also kept as weak references so that ``annotate`` can
check an id still names the same tensor. No tensor or autograd node outlives the event.

NOTE [never change the program]
The user's call runs exactly as without the mode; everything the mode does afterwards is bookkeeping,
and an error there (torch refusing to give the ``grad_fn`` of a view whose base was modified, an exotic
tensor subclass) is swallowed and counted as a dropped event, never raised into the forward pass.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from gradscope._frames import frame_location, user_frame
from gradscope._torch import ACCUMULATE_GRAD, TENSOR_DATA, TENSOR_DTYPE, impl_key, peek_sequence_nr, storage_key
from gradscope._torch import version as tensor_version
from gradscope.tracing.dtypeflow import CAST_NAMES
from gradscope.tracing.follow import CutFollower
from gradscope.tracing.inside import InsideFunctions
from gradscope.tracing.probes import (
    INPLACE_FLAG,
    SAVES_OUTPUT,
    grad_inputs,
    in_checkpoint,
    in_optimizer,
    inside_function,
    requires_grad,
    user_location,
    versions,
)
from gradscope.tracing.sites import cut_site
from gradscope.walk.release import keep_until_dead
from gradscope.walk.traverse import traverse

__all__ = ["CutMode", "user_location", "param_ids", "MAX_EVENTS", "WALK_LIMIT"]

MAX_EVENTS = 10_000  # events kept per recording; later ones are only counted
WALK_LIMIT = 1_000_000  # nodes visited per event to find its parameters
_DEEP = 10_000  # from this many nodes on, release our wrappers safely: NOTE [freeing deep graphs]

_peek_seq = peek_sequence_nr
_ACCUMULATE = ACCUMULATE_GRAD
_DATA = TENSOR_DATA
_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled

# Categories (NOTE [cheap per-op path]); small ints compare fastest. _CAST and _DTYPE: NOTE [dtype flow].
_PLAIN, _GETTER, _DETACH, _DATA_GET, _TO_PYTHON, _INPLACE, _FUNCTIONAL, _CAST, _DTYPE, _DETACH_ = range(10)

_TO_PYTHON_NAMES = frozenset(
    {"item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__", "__complex__", "__array__"}
)
_INPLACE_DUNDERS = frozenset(
    "__setitem__ __iadd__ __isub__ __imul__ __itruediv__ __ifloordiv__ __imod__ __ipow__ __iand__ __ior__ "
    "__ixor__ __ilshift__ __irshift__ __imatmul__".split()
)
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad", "detach_"})
# Ops that carry a detached tensor on towards .numpy() (x.detach().cpu().numpy()).
_CARRY = frozenset({"cpu", "to", "contiguous", "clone", "float", "double", "resolve_conj", "resolve_neg"})

_CATEGORY: dict = {}
_CUT_KINDS = frozenset({"detach", ".data", "no_grad", "non-differentiable"})


def _classify(func) -> int:
    name = getattr(func, "__name__", "")
    if name == "__get__" or name == "__set__":
        owner = getattr(func, "__self__", None) if name == "__get__" else None
        cat = _DATA_GET if owner is _DATA else _DTYPE if owner is TENSOR_DTYPE else _GETTER
    elif name in CAST_NAMES:
        cat = _CAST
    elif name == "detach":
        cat = _DETACH
    elif name == "detach_":
        cat = _DETACH_  # recorded before the call: see _detach_inplace
    elif name in _TO_PYTHON_NAMES:
        cat = _TO_PYTHON
    elif name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES):
        cat = _INPLACE
    elif getattr(func, "__module__", None) == "torch.nn.functional":
        cat = _FUNCTIONAL  # NOTE [in-place writes inside torch functions]
    else:
        cat = _PLAIN
    if not isinstance(getattr(func, "__self__", None), _Tensor):  # never keep a tensor alive in the cache
        try:
            _CATEGORY[func] = cat
        except TypeError:  # an unhashable callable: classify it every time
            pass
    return cat


def _op_name(func) -> str:
    name = getattr(func, "__name__", None) or type(func).__name__
    if name == "__get__":
        return "." + getattr(getattr(func, "__self__", None), "__name__", "attribute")
    return name


class CutMode(TorchFunctionMode):
    """Records cut and in-place events into ``rec`` (a :class:`gradscope.tracing.recorder.Trace`)."""

    def __init__(self, rec):
        super().__init__()
        self.rec = rec
        self._detached: Any = None  # (weakref to the last detach() output, its event index)
        self._follow = CutFollower(rec)  # NOTE [where a cut joins]
        self._inside = InsideFunctions(rec, self._follow, param_ids, _leaf)
        self._follow.on_pending = self._inside.returned
        self._made = {}  # NOTE [in-place inside reentrant checkpoint]: id -> (weakref, op)
        self._ckpt_seen = False
        self._views_written = False  # NOTE [in-place on a slice]
        self._lines = rec.node_lines  # NOTE [node lines]
        self._end = self._lines.end
        self._regions = rec.regions  # NOTE [recording a reentrant region]
        self._flow = rec.dtypes  # NOTE [dtype flow]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            cat = _CATEGORY[func]
        except KeyError:
            cat = _classify(func)
        except TypeError:
            cat = _PLAIN
        before = versions(args, kwargs) if cat == _FUNCTIONAL else None
        if cat == _DETACH_:
            try:
                self._detach_inplace(func, args)
            except Exception:  # noqa: BLE001 - NOTE [never change the program]
                self.rec.drop_event()
        seq = _peek_seq()
        out = func(*args, **kwargs) if kwargs else func(*args)
        try:
            end = _peek_seq()
            if self._follow.cut and end != seq:  # NOTE [where a cut joins]
                self._follow.join(args, kwargs, seq, end)
            if end != seq or seq != self._end:  # NOTE [node lines]: nodes were made
                self._lines.note(seq, end)
                self._end = end
            if before:
                self._functional_writes(func, before, kwargs or {})
            if self._flow.marks or cat == _CAST or (kwargs and "dtype" in kwargs):  # NOTE [dtype flow]
                self._flow.call(_op_name(func), cat == _CAST, args, kwargs or {}, out, seq, end)
            if cat == _PLAIN or cat == _FUNCTIONAL or cat == _CAST:  # NOTE [cheap per-op path]
                if isinstance(out, _Tensor):
                    if not out.requires_grad:
                        self._plain_cut(func, args, kwargs or {}, out, seq)
                    elif end == seq and not _grad_enabled():  # no node: a view under no_grad (in a region?)
                        self._regions.call(func, args, kwargs, out, seq)
                elif isinstance(out, (tuple, list)):
                    rg = requires_grad(out)
                    if rg is False:
                        self._plain_cut(func, args, kwargs or {}, out, seq)
                    elif rg and end == seq and not _grad_enabled():
                        self._regions.call(func, args, kwargs, out, seq)
            elif cat == _GETTER or cat == _DTYPE:
                if cat == _DTYPE and args:
                    self._flow.dtype_read(args[0], sys._getframe(1))
                if seq == self._regions.region_seq and isinstance(out, _Tensor):  # x.T inside a region
                    self._regions.call(func, args, kwargs, out, seq)
            elif cat == _INPLACE:
                if args and isinstance(args[0], _Tensor):
                    self._inplace(func, args[0])
                if seq != self._regions.no_region_seq and not _grad_enabled():  # in a reentrant region?
                    self._regions.call(func, args, kwargs, out, seq)
            elif args and isinstance(args[0], _Tensor):
                self._special(cat, func, args[0], out)
                if cat != _TO_PYTHON and seq != self._regions.no_region_seq and not _grad_enabled():
                    self._regions.call(func, args, kwargs, out, seq)
        except Exception:  # noqa: BLE001 - NOTE [never change the program]
            self.rec.drop_event()
        return out

    # -- the rare paths ---------------------------------------------------------------------------
    def _plain_cut(self, func, args, kwargs, out, seq) -> None:
        regions = self._regions
        if seq != regions.no_region_seq and not _grad_enabled():  # NOTE [recording a reentrant region]
            regions.call(func, args, kwargs, out, seq)
        inputs = grad_inputs(args, kwargs)
        if (self._ckpt_seen or inputs) and isinstance(out, _Tensor) and _op_name(func) in SAVES_OUTPUT:
            self._note_made(func, out)
        if not inputs:
            if self._follow.cut and isinstance(out, _Tensor):
                self._follow.carry(args, kwargs, out)
            if self._detached is not None and args and _op_name(func) in _CARRY:
                ref, index = self._detached
                if ref() is args[0] and isinstance(out, _Tensor):
                    self._detached = (weakref.ref(out), index)
            return
        name = _op_name(func)
        if not torch.is_grad_enabled():
            kind = "no_grad"
        elif name.endswith("_like") or (name.startswith("new_") and name != "new_tensor"):
            return  # a factory that reads only the shape: no data flows, nothing was cut
        else:
            kind = "non-differentiable"
        self._record(kind, name, inputs, out=out)

    def _special(self, cat, func, t, out) -> None:
        if not t.requires_grad:
            if cat == _TO_PYTHON and self._detached is not None:
                self._upgrade_detach(func, t)
            return
        if cat == _DETACH:
            index = self._record("detach", _op_name(func), [t], out=out)
            if index is not None and isinstance(out, _Tensor):
                self._detached = (weakref.ref(out), index)
        elif cat == _DATA_GET:
            self._record(".data", ".data", [t], out=out)
        else:
            self._record("to-python", _op_name(func), [t])

    def _detach_inplace(self, func, args) -> None:
        # x.detach_() detaches x itself (no grad_fn after it): record its line and parameters before the call
        if args and isinstance(args[0], _Tensor) and args[0].requires_grad:
            self._record("detach", _op_name(func), [args[0]], out=args[0])

    def _upgrade_detach(self, func, t) -> None:
        # x.detach().numpy(): torch refuses .numpy() on a tensor that requires grad, so the detach is the
        # cut; report it as the conversion to Python it was made for, at the detach's location.
        ref, index = self._detached
        if ref() is t:
            self.rec.relabel_event(index, "to-python", _op_name(func))
            self._detached = None

    def _inplace(self, func, t) -> None:
        try:
            shape = list(t.shape)
            version = tensor_version(t)
        except RuntimeError:  # inference tensors have no version counter; nested tensors no shape
            return
        extra = {}
        if self._made:
            ref, op = self._made.get(id(t), (None, None))
            region = in_checkpoint() if ref is not None and ref() is t else None
            if region is not None:
                extra["producer"], extra["region"] = op, region
        if t._base is not None:  # NOTE [in-place on a slice]: which storage, written through a view
            try:
                extra["storage"], extra["view"] = storage_key(t), True
            except (RuntimeError, NotImplementedError):
                pass
        elif self._views_written:
            try:
                extra["storage"] = storage_key(t)
            except (RuntimeError, NotImplementedError):
                pass
        self._views_written = self._views_written or bool(extra.get("view"))
        self._record("inplace", _op_name(func), (), shape=shape, version=version, extra=extra)

    def _functional_writes(self, func, before, kwargs) -> None:
        name = _op_name(func)
        for t, v in before:
            if tensor_version(t) != v:
                how = "max_norm=..." if name == "embedding" else "inplace=True" if name in INPLACE_FLAG else "..."
                self._record("inplace", f"{name}({how})", (), shape=list(t.shape), version=tensor_version(t))

    def _note_made(self, func, out) -> None:
        if not torch.is_grad_enabled() and in_checkpoint() is not None:
            self._ckpt_seen = True
            made = self._made
            if len(made) > 4096:
                for k in [k for k, (r, _) in made.items() if r() is None]:
                    del made[k]
            made[id(out)] = (weakref.ref(out), _op_name(func))

    def _record(self, kind, op, inputs, shape=None, version=None, extra=None, out=None) -> int | None:
        rec = self.rec
        if kind != "inplace" and inside_function():
            region = in_checkpoint()
            self._ckpt_seen = self._ckpt_seen or region is not None
            self._inside.note(inputs, out, region)  # NOTE [cuts that show after a Function returns]
            return None  # NOTE [cuts inside autograd.Function]
        if rec.full():
            rec.drop_event()
            return None
        if in_optimizer():
            if kind != "inplace":
                return None  # an optimizer's state or update under no_grad cuts no forward graph
            extra = {**(extra or {}), "optimizer": True}
        frame = user_frame(sys._getframe(2))
        location = frame_location(frame)
        if kind in _CUT_KINDS:
            extra = cut_site(kind, frame, location, extra, rec)
            if extra is not None and "op_location" in extra:
                location = extra["location"]
                del extra["location"]
        del frame
        params = param_ids(inputs, rec.leaf_refs) if inputs else ()
        index = rec.record_event(kind, op, location, params, _peek_seq(), shape, version, extra)
        if kind in _CUT_KINDS and isinstance(out, _Tensor):
            rec.follow_event(index)
            self._follow.track(out, index)
        return index


def param_ids(inputs, refs: dict) -> tuple[int, ...]:
    """Ids of the leaf tensors (parameters) that feed ``inputs``; each id is remembered with its TensorImpl key."""
    found: dict[int, None] = {}
    stack = []
    for t in inputs:
        try:
            node = t.grad_fn
        except RuntimeError:  # a multi-output view whose base was written in place: torch refuses
            node = None  # its grad_fn; the parameters that feed it feed its base
        if node is None and t._base is not None:  # also a view taken under no_grad (.sample())
            t = t._base
            node = t.grad_fn
        if node is not None:
            stack.append(node)
        elif t is not None:
            _leaf(t, found, refs)

    def visit(node) -> bool:
        if type(node) is _ACCUMULATE:
            _leaf(node.variable, found, refs)
            return False
        return True

    order = traverse(stack, visit, WALK_LIMIT)  # discovery (root-first) order, for keep_until_dead
    if len(order) >= _DEEP:
        keep_until_dead(inputs, order)
    return tuple(found)


def _leaf(t, found: dict, refs: dict) -> None:
    key = id(t)
    found[key] = None
    if key not in refs:
        try:  # no reference to a parameter, not even a weak one (see _torch.impl_key)
            refs[key] = impl_key(t)
        except (AttributeError, RuntimeError):
            pass
