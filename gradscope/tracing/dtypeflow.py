"""What a lower-precision run of the traced forward would compute in float32: the forward's explicit casts.

NOTE [dtype flow]
Under FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` the forward runs on bfloat16
parameters and inputs, and a model that wants float32 somewhere says so: RMSNorm's
``hidden_states.to(torch.float32)`` ... ``.to(input_dtype)``, a loss on ``logits.float()``,
``softmax(x, dtype=torch.float32).to(q.dtype)``. In a float32 trace those casts are no-ops (``x.to(float32)``
of a float32 tensor is ``x`` itself, no node), so :class:`DtypeFlow` follows them as the forward runs:
each float32 tensor of the trace is in one of three states for the lower-precision run

- ``PARAM`` (the default, unmarked): in ``param_dtype``, like the parameters and the inputs FSDP2 casts;
- ``UP``: float32, cast up from ``param_dtype`` (a region the model may cast back);
- ``NATIVE``: float32 in its own right: a module's floating buffer (FSDP2 casts parameters, not buffers),
  a float32 tensor made from integers (``position_ids.float()``), a factory with ``dtype=torch.float32``.

Rules, for the float32 tensors the mode sees (others are real casts in the trace too, never marked):

- ``.float()``, ``.to(torch.float32)``, ``.type(torch.float32)`` and ``dtype=torch.float32`` of any other
  op: from ``PARAM``, ``UP``; from ``NATIVE`` or a non-float32 tensor, ``NATIVE``. A ``.to(dtype)`` /
  ``.type(dtype)`` of an ``UP`` tensor is the cast back (``.to(input_dtype)``, where ``input_dtype`` was
  read as ``x.dtype`` before the region: in the trace it is float32 too): ``PARAM``. ``.float()`` is
  never a cast back.
- A target read on the same line (``cos.to(dtype=x.dtype)``, ``.to(q.dtype)``: the mode sees the
  ``.dtype`` read just before the call, from the same frame and line) takes the state of the tensor read;
  ``.to(other)`` and ``.type_as(other)`` take ``other``'s.
- Any other op: type promotion: float32 (``UP`` unless every float32 input is ``NATIVE``) when a
  float32 input has dimensions, or every input is 0-dim, and one of them is float32; else ``PARAM``.
- A cast that returns its input (no-op in the trace) marks that same tensor, and the tensor is the
  residual stream too (RMSNorm's ``hidden_states``): such a mark lasts until the module call it was made
  in returns (the loss outside any module: until the trace ends).

What it records: the storages each op that made nodes read or wrote in float32 (its saved float32 slots),
which of those nodes' outputs are float32 (their gradients), and each cast that is a no-op in the trace
but a ``ToCopyBackward0`` node in the lower-precision run (``softmax(x, dtype=torch.float32)`` of an
``x`` in ``param_dtype`` makes one too), with the nodes that read it. ``annotate`` writes them as
``graph.graph[DTYPE_FLOW]``; ``memory/sharding/precision.py`` replays the step with exactly those in
float32 and those nodes added. Limits: ``autocast`` regions are not followed; ``x.float().float()`` is
one cast; a ``.to(dtype)`` of an ``UP`` tensor to a dtype meant as float32 is read as the cast back
(under-predicting that tensor); a tensor cast and also used uncast in the same module call is taken as
cast for both; a factory whose ``dtype=`` was read from a tensor on an earlier line is ``NATIVE`` (the
larger). Casts inside a custom ``autograd.Function`` or a torch function that does not dispatch through
the mode are not seen. Recording changes no tensor: marks are weak references (a parameter or buffer: its
id and TensorImpl key), reads are storage pointers and sequence numbers
(docs/internals.md#dtype-flow).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from gradscope._frames import user_caller
from gradscope._torch import impl_key, sequence_nr, storage_key
from gradscope.graph import DTYPE_FLOW

__all__ = ["DtypeFlow", "annotate", "CAST_NAMES", "PARAM", "UP", "NATIVE"]

PARAM, UP, NATIVE = 0, 1, 2
#: The tensor methods that are casts (``.double()`` / ``.half()`` / ``.bfloat16()`` are real casts in a
#: float32 trace: their outputs are not float32 and are never marked).
CAST_NAMES = frozenset({"to", "float", "type", "type_as"})
_F32 = torch.float32
_Tensor = torch.Tensor


def _line(code, lasti: int) -> int | None:
    """The source line of the instruction at ``lasti`` in ``code``."""
    for start, end, line in code.co_lines():
        if start <= lasti < end:
            return line
    return None


class DtypeFlow:
    """The dtype flow of one traced forward (NOTE [dtype flow]); the mode calls it, the trace annotates."""

    def __init__(self) -> None:
        self.marks: dict[int, tuple] = {}  # id(tensor) -> (weakref or None, impl key or None, state, call)
        self._scoped: list[tuple] = []  # (depth, id, previous mark or None): marks of no-op casts
        self._depth = 0
        self._call = -1  # the innermost open module call (the trace's call index, in entry order)
        self._read: Any = None  # the last .dtype read: (id(frame), code, lasti, state)
        self.reads: list[tuple[int, int, int]] = []  # (first seq, end seq, storage pointer) read in float32
        self.outputs: list[tuple[int, int]] = []  # (first seq, end seq) of ops whose outputs are float32
        self.casts: list[tuple[int, int, int, int]] = []  # (seq at the cast, producer seq, output nr, state)
        self.uses: list[tuple[int, int, int]] = []  # (cast index, first seq, end seq): ops that read a cast

    # -- what the trace tells it ------------------------------------------------------------------
    def depth(self, depth: int, call: int) -> None:
        """The module call stack is ``depth`` deep now, ``call`` the innermost: drop the scoped marks of the
        calls that returned."""
        self._depth, self._call = depth, call
        scoped = self._scoped
        while scoped and scoped[-1][0] > depth:
            _, key, prev = scoped.pop()
            if prev is None:
                self.marks.pop(key, None)
            else:
                self.marks[key] = prev

    def buffers(self, module) -> None:
        """A module is called: its floating float32 buffers are ``NATIVE`` (FSDP2 casts no buffer)."""
        for b in module._buffers.values():
            if b is not None and b.dtype is _F32 and id(b) not in self.marks:
                self.marks[id(b)] = (None, impl_key(b), NATIVE, -1, None)

    def dtype_read(self, t, frame) -> None:
        """``t.dtype`` was read from ``frame`` (the caller of the getter)."""
        self._read = (id(frame), frame.f_code, frame.f_lasti, self.state(t)) if frame is not None else None

    # -- the mode's calls ---------------------------------------------------------------------------
    def state(self, t) -> int:
        """``t``'s state (NOTE [dtype flow]); ``PARAM`` when unmarked."""
        e = self.marks.get(id(t))
        if e is None:
            return PARAM
        ref, impl, state = e[0], e[1], e[2]
        if (ref() is t) if ref is not None else (impl == impl_key(t)):
            return state
        del self.marks[id(t)]
        return PARAM

    def call(self, name: str, cast: bool, args, kwargs: dict, out, seq: int, end: int) -> None:
        """One torch call ``name(*args, **kwargs) -> out`` that made the nodes ``[seq, end)``."""
        if not isinstance(out, _Tensor):
            if isinstance(out, (tuple, list)) and self.marks:
                outs = [o for o in out if isinstance(o, _Tensor) and o.dtype is _F32]
                state, ins = self._promote(args, kwargs)
                if end != seq:
                    self._note_uses(ins, seq, end)
                if state and outs:
                    self._write(outs, state, ins, seq, end)
            return
        if out.dtype is not _F32:
            return
        target = self._target(name, args, kwargs) if cast or "dtype" in kwargs else None
        if target is None:
            state, ins = self._promote(args, kwargs)
        else:
            src = args[0] if args and isinstance(args[0], _Tensor) else None
            state, ins = self._cast(name, target, src), ([src] if src is not None else [])
            if not cast and end != seq and src is not None and src.grad_fn is not None and self.state(src) != state:
                self.uses.append((len(self.casts), seq, end))  # softmax(x, dtype=): x cast first, in the op
                self.casts.append((seq, sequence_nr(src.grad_fn), src.output_nr, state))
        if any(o is out for o in ins):  # a no-op cast: the same tensor
            self._recast(out, state, seq)
            return
        if end != seq:
            self._note_uses(ins, seq, end)
        if state:
            self._write([out], state, ins, seq, end)

    def _recast(self, t, state: int, seq: int) -> None:
        """A no-op cast of ``t`` to ``state``. A tensor this module call made (its mark is from this call or
        one it entered since) keeps the new state; any other (the residual stream a norm casts) only until
        this call returns."""
        if self.state(t) == state:  # (drops a stale mark first)
            return
        prev = self.marks.get(id(t))
        if prev is None or prev[3] < self._call:
            self._scoped.append((self._depth, id(t), prev))
        cast = None
        if t.grad_fn is not None:  # the lower-precision run has a ToCopyBackward0 node here
            cast = len(self.casts)
            self.casts.append((seq, sequence_nr(t.grad_fn), t.output_nr, state))
        self.marks[id(t)] = (_ref(t), None if t.grad_fn is not None else impl_key(t), state, self._call, cast)

    def _note_uses(self, ins: list, seq: int, end: int) -> None:
        """The nodes ``[seq, end)`` read inputs that a no-op cast marked: their gradient goes through it."""
        marks = self.marks
        for t in ins:
            e = marks.get(id(t))
            if e is not None and e[4] is not None and self.state(t) == e[2]:
                self.uses.append((e[4], seq, end))

    # -- the rules ----------------------------------------------------------------------------------
    def _target(self, name: str, args, kwargs: dict):
        """The state a cast goes to: ``"f32"`` (a float32 literal or variable), a state (a tensor's, or
        a ``.dtype`` read on the same line), or None (not a cast to float32)."""
        if name == "float":
            return "float"
        if name == "type_as":
            other = args[1] if len(args) > 1 else kwargs.get("other")
            return self.state(other) if isinstance(other, _Tensor) and other.dtype is _F32 else None
        dtype = kwargs.get("dtype")
        for a in args[1:]:
            if isinstance(a, _Tensor):
                return self.state(a) if a.dtype is _F32 and name == "to" else None
            if isinstance(a, torch.dtype):
                dtype = a
        if dtype is not _F32:
            return None
        read, self._read = self._read, None
        if read is not None:
            f = user_caller(4)
            if f is not None and id(f) == read[0] and f.f_code is read[1] and read[2] <= f.f_lasti:
                if _line(read[1], read[2]) == _line(f.f_code, f.f_lasti):
                    return read[3]
        return "f32"

    def _cast(self, name: str, target, src) -> int:
        if target != "f32" and target != "float":
            return target
        if src is None or not src.is_floating_point():
            return NATIVE  # a factory, or integers made float32
        if src.dtype is not _F32:
            return NATIVE if src.dtype == torch.float64 else UP
        state = self.state(src)
        if state == UP and target == "f32" and name in ("to", "type"):
            return PARAM  # NOTE [dtype flow]: the cast back
        return NATIVE if state == NATIVE else UP

    def _promote(self, args, kwargs: dict) -> tuple[int, list]:
        """The promoted state of the float32 tensor inputs, and those inputs."""
        ins = [a for a in _tensors(args, kwargs) if a.dtype is _F32]
        if not ins or not self.marks:
            return PARAM, ins
        dimmed = [a for a in ins if a.dim()] or ins
        states = [self.state(a) for a in dimmed]
        if not any(states):
            return PARAM, ins
        return (NATIVE if all(s == NATIVE for s in states) else UP), ins

    def _write(self, outs: list, state: int, ins: list, seq: int, end: int) -> None:
        for o in outs:  # new tensors (never a parameter or a buffer): a weak reference
            self.marks[id(o)] = (weakref.ref(o), None, state, self._call, None)
        if end == seq:
            return  # no node: nothing saved, no gradient
        self.outputs.append((seq, end))
        for t in [a for a in ins if self.state(a)] + outs:
            try:
                self.reads.append((seq, end, storage_key(t)))
            except (RuntimeError, NotImplementedError):
                continue


def annotate(flow: DtypeFlow, graph) -> None:
    """Write ``graph.graph[DTYPE_FLOW]`` (NOTE [dtype flow]; the format: ``gradscope/graph/schema.py``)."""
    ptrs = getattr(getattr(graph, "compact", None), "storage_ptrs", None) or {}
    by_seq = {d["seq"]: n for n, d in graph.nodes(data=True) if d.get("kind") == "op" and d.get("seq") is not None}
    nodes: dict[str, dict] = {}

    def entry(nid: str) -> dict:
        return nodes.setdefault(nid, {"saved": [], "outputs": []})

    for seq, end, ptr in flow.reads:
        sid = ptrs.get(ptr)
        for nid in _made(by_seq, seq, end) if sid is not None and sid >= 0 else ():
            saved = graph.nodes[nid].get("saved") or ()
            if sid not in entry(nid)["saved"] and any(x.get("storage") == sid for x in saved):
                entry(nid)["saved"].append(sid)
    for seq, end in flow.outputs:
        for nid in _made(by_seq, seq, end):
            entry(nid)["outputs"] = list(range(len(graph.nodes[nid].get("out_shapes") or [None])))
    users: dict[int, list] = {}
    for k, seq, end in flow.uses:
        users.setdefault(k, []).extend(_made(by_seq, seq, end))
    casts = []
    for k, (seq, of_seq, nr, state) in enumerate(flow.casts):
        of = by_seq.get(of_seq)
        by = sorted({n for n in users.get(k, ()) if of is not None and of in graph.pred[n]})
        if by:
            casts.append({"of": of, "output": nr, "seq": seq, "to": "float32" if state else "param", "by": by})
    graph.graph[DTYPE_FLOW] = {
        "nodes": {n: e for n, e in nodes.items() if e["saved"] or e["outputs"]},
        "casts": casts,
    }


def _made(by_seq: dict, seq: int, end: int) -> list:
    """The op nodes numbered ``[seq, end)``."""
    return [by_seq[s] for s in range(seq, end) if s in by_seq]


def _ref(t):
    """A weak reference to a tensor that has a ``grad_fn``; None for a leaf (never a weak reference to a
    parameter or buffer: ``torch.utils.swap_tensors`` refuses one that has)."""
    return weakref.ref(t) if t.grad_fn is not None else None


def _tensors(args, kwargs: dict) -> list:
    out = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, _Tensor):
            out.append(a)
        elif isinstance(a, (tuple, list)):
            out.extend(t for t in a if isinstance(t, _Tensor))
    return out
