"""What an in-place write on a view hides: the op inside a ``CopySlices`` node, read as plain data.

NOTE [CopySlices formula] (docs/internals.md#copyslices-hides-its-op)
``x[:, :k].relu_()``, or ``ReLU(inplace=True)`` on a view (a ``Linear``'s 3-d output is one), makes a
``CopySlices`` node that wraps the op's own backward node and exposes neither it nor the tensors it saved
(``relu_`` saves its result, which shares the written tensor's storage). The walk calls the node once, on a
``meta`` gradient of its output's shape, under a ``TorchDispatchMode`` that runs every aten call on ``meta``
stand-ins of its arguments: no kernel touches the user's tensors, nothing is written, no version changes,
no tensor is kept. The calls the node makes (the gradient copied into a new tensor of the base's shape,
the slice, its ``clone``, the wrapped op's formula, the copy back) are recorded as plain data
(``attrs["formula"]``: what ``memory/kernels/formula.py`` runs again on fresh tensors to measure the
node's in-node memory), and every tensor an argument brings from outside the call (the wrapped node's
saved tensors) becomes a saved slot ``hidden[k]`` of the CopySlices node, with its storage: backward frees
it when CopySlices runs, and the replay does too. A hidden tensor written in place since it was saved makes
the call raise torch's own version error: the slot is then ``stale`` (shape and versions from the message).
While the node runs, a profile hook refuses any Python code but the mode's own (a custom Function's
``backward`` applied in place on a view, a checkpoint's or a saved-tensor hook's unpack): the call stops
before that code runs and the node keeps the reason in ``attrs["formula_unread"]``.
"""

from __future__ import annotations

import re
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradscope._torchcheck import readable
from gradscope.walk.slots import FREED_MARK, VERSION_RE, StorageIds, blank, slot_meta
from gradscope.walk.values import dtype_str

__all__ = ["read_copyslices", "NAME"]

#: The node class whose op is hidden (``type(node).__name__``).
NAME = "CopySlices"
_PLAIN = (int, float, bool, str, type(None))
_TENSOR_IN_MESSAGE = re.compile(r"\[torch\.(?:cuda\.)?(\w+)Tensor \[([\d, ]*)\]\]")
_OUTPUT_OF = re.compile(r"which is output \d+ of (\w+),")
_LEGACY_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
                  "Long": "int64", "Int": "int32", "Bool": "bool"}  # fmt: skip
#: Python references :func:`_register`'s path holds on a hidden tensor when ``StorageIds.key`` counts them
#: (the list, the loop variable, ``slot_meta``'s and ``key``'s parameters, getrefcount's argument, the
#: reference the TensorImpl keeps on its preserved wrapper;
#: checked by tests/memory/test_copyslices.py: a tensor the user holds stays external, one only the node
#: holds does not).
_HIDDEN_REFS = 7


class _Foreign(Exception):
    """Python code other than the recorder's would run inside the node."""


class _Recorder(TorchDispatchMode):
    """Runs each aten call on meta stand-ins and records it (refs: ``g`` the gradient, ``v`` call outputs,
    ``s`` tensors from outside)."""

    def __init__(self, grad: torch.Tensor) -> None:
        super().__init__()
        self.calls: list = []
        self.refs: dict = {grad._cdata: {"t": "g"}}
        self.keep: list = [grad]  # meta values stay alive while the node runs: their keys stay unique
        self.hidden: list = []
        self.hidden_keys: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        enc = [self._enc(a) for a in args], {k: self._enc(v) for k, v in kwargs.items()}
        out = func(*[_meta(a) for a in args], **{k: _meta(v) for k, v in kwargs.items()})
        i = len(self.calls)
        self.calls.append([str(func), enc[0], enc[1]])
        for j, o in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor) and o._cdata not in self.refs:
                self.refs[o._cdata] = {"t": "v", "i": i, "j": j}
                self.keep.append(o)
        return out

    def _enc(self, v):
        if isinstance(v, torch.Tensor):
            ref = self.refs.get(v._cdata)
            if ref is not None:
                return ref
            k = self.hidden_keys.get(v._cdata)
            if k is None:
                k = self.hidden_keys[v._cdata] = len(self.hidden)
                self.hidden.append(v)
            return {"t": "s", "k": k}
        if isinstance(v, _PLAIN):
            return v
        if isinstance(v, torch.dtype):
            return {"dtype": dtype_str(v)}
        if isinstance(v, (torch.memory_format, torch.layout)):
            return {type(v).__name__: str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"device": None}
        if isinstance(v, (list, tuple)):
            return [self._enc(x) for x in v]
        raise _Foreign(f"it passes a {type(v).__name__} to {v!r}")


def _meta(v):
    if isinstance(v, torch.Tensor):
        if v.device.type == "meta":
            return v
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    if isinstance(v, torch.device):
        return torch.device("meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_meta(x) for x in v)
    return v


def _dispatch_rule_code():
    """``torch._library.simple_registry.find_torch_dispatch_rule``'s code (the one torch function the
    recorder's dispatch calls), or None on a torch without it (then no CopySlices formula is read)."""
    try:
        from torch._library.simple_registry import find_torch_dispatch_rule
    except ImportError:
        return None
    return find_torch_dispatch_rule.__code__


_ALLOWED = frozenset(c for c in (_Recorder.__torch_dispatch__.__code__, _dispatch_rule_code()) if c is not None)


def _guard():
    """A profile function that raises :class:`_Foreign` when Python code outside the recorder is called."""
    depth = 0

    def hook(frame, event, arg):
        nonlocal depth
        if event == "call":
            if depth or frame.f_code in _ALLOWED:
                depth += 1
                return
            code = frame.f_code
            raise _Foreign(f"it would run Python code ({code.co_name} in {code.co_filename.rsplit('/', 1)[-1]})")
        if event == "return" and depth:
            depth -= 1

    return hook


def _call(node, rec: _Recorder, grad: torch.Tensor):
    previous = sys.getprofile()
    with torch.no_grad(), rec:
        sys.setprofile(_guard())
        try:
            return node(grad)
        finally:
            sys.setprofile(previous)


def _stale(message: str) -> dict | None:
    """The stale hidden slot torch's version error describes, or None."""
    m = VERSION_RE.search(message)
    if m is None:
        return None
    entry = blank("hidden[0]", "stale")
    entry.update(version=int(m.group(1)), saved_version=int(m.group(2)))
    op = _OUTPUT_OF.search(message)
    if op is not None:
        entry["hidden_op"] = op.group(1)
    t = _TENSOR_IN_MESSAGE.search(message)
    if t is not None:
        shape = [int(x) for x in t.group(2).split(",") if x.strip()]
        entry.update(shape=shape, dtype=_LEGACY_DTYPES.get(t.group(1)))
    return entry


def _register(hidden: list, storages: StorageIds) -> list[dict]:
    """The saved-slot entries of the hidden tensors (their storages registered as any saved slot's)."""
    out = []
    for k in range(len(hidden)):
        t = hidden[k]
        out.append(slot_meta(f"hidden[{k}]", t, "live", storages, refs=_HIDDEN_REFS))
    return out


def read_copyslices(node, storages: StorageIds) -> tuple[list[dict], dict]:
    """``(saved, attrs)`` of a CopySlices node: its hidden saved tensors and the formula it runs."""
    unread = readable("dispatch-rules")
    if unread is not None:
        return [], {"formula_unread": unread}
    try:
        meta = node._input_metadata
        grad = torch.empty(tuple(meta[0].shape), dtype=meta[0].dtype, device="meta")
    except (AttributeError, IndexError, RuntimeError) as e:
        return [], {"formula_unread": f"its gradient's shape is not known ({e})"}
    rec = _Recorder(grad)
    try:
        got = _call(node, rec, grad)
    except _Foreign as e:
        return [], {"formula_unread": str(e)}
    except Exception as e:  # noqa: BLE001 - torch refused the call: the reason is kept, never raised
        text = str(e)
        stale = _stale(text)
        if stale is not None:
            return [stale], {"formula_unread": "a tensor it saved was modified in place since"}
        if FREED_MARK in text:
            return [], {"formula_unread": "a backward already freed it"}
        return [], {"formula_unread": f"calling it on a meta gradient failed: {text.splitlines()[0][:160]}"}
    outs = got if isinstance(got, (tuple, list)) else (got,)
    formula = {
        "calls": rec.calls,
        "out": [rec.refs.get(o._cdata) if isinstance(o, torch.Tensor) else None for o in outs],
        "hidden": len(rec.hidden),
    }
    hidden, rec.hidden = rec.hidden, []
    del got, outs, rec
    return _register(hidden, storages), {"formula": formula}
