"""``gradscope.trace()``: which module made each autograd node, and where the forward cut the graph.

NOTE [module attribution by sequence numbers]
Autograd numbers nodes in creation order, per thread (``node._sequence_nr()``), and
``torch._C._autograd._get_sequence_nr()`` peeks the next number without using it. A global forward
pre-hook and a forward hook (``always_call=True``, so it also runs when forward raises) cut that number
line into segments: at each module entry and exit we note ``(next seq, innermost module call)``. A node
belongs to the segment its number falls in (``bisect``). Modules are recorded by ``id`` plus a weak
reference, and names are resolved only in :meth:`Trace.annotate`, from the model given to
``inspect``/``trace``; a module missing from that model (a loss module, a module built on the fly) is
skipped, so its ops go to the enclosing named module. Hooks only listen to the thread that entered the
trace, because the numbers are per thread.
"""

from __future__ import annotations

import threading
import weakref
from bisect import bisect_right
from typing import Literal

import torch

from gradscope import _torch
from gradscope._format import one_line
from gradscope._wrappers import unwrap
from gradscope.errors import InputTypeError, InputValueError
from gradscope.graph import CALLED_MODULES, CHECKPOINT_PARAMS, EVENTS, EVENTS_DROPPED, MODULE_CALLS, PARAMS
from gradscope.tracing.calls import annotate_batch, call_names, live_modules, module_calls, note_batch
from gradscope.tracing.dtypeflow import DtypeFlow
from gradscope.tracing.dtypeflow import annotate as annotate_dtypes
from gradscope.tracing.events import RecordedEvent, event_dicts
from gradscope.tracing.lines import NodeLines
from gradscope.tracing.modes import MAX_EVENTS
from gradscope.tracing.newleaf import LeafMode
from gradscope.tracing.regions import RegionRecorder

__all__ = ["Trace", "trace"]

_peek_seq = _torch.peek_sequence_nr
_get_ident = threading.get_ident
_U64_MAX = _torch.NO_SEQUENCE_NR


def trace(model: torch.nn.Module | None = None) -> Trace:
    """Record module attribution and graph cuts during a forward pass, for :func:`gradscope.inspect`.

    Args:
        model: optional ``nn.Module`` that names modules and parameters (names relative to it). Without
            it, names come from the ``model=`` later given to ``inspect``.

    Returns:
        A :class:`Trace`: ``with gradscope.trace() as tr:``, then ``inspect(loss, model=model, trace=tr)``.

    Raises:
        InputTypeError: ``model`` is not an ``nn.Module``.

    Example:
        >>> import torch, gradscope
        >>> lin = torch.nn.Linear(3, 1)
        >>> with gradscope.trace(lin) as tr:
        ...     loss = lin(torch.randn(2, 3)).detach().sum()
        >>> tr.events[0]["kind"], tr.events[0]["params"]
        ('detach', ['bias', 'weight'])
    """
    return Trace(model)


class Trace:
    """A recording of one forward pass (see :func:`trace`). Holds plain data only.

    Entering the same object again starts a fresh recording; entering it while it is recording raises.
    Nested traces (``with trace(): ... with trace(): ...``) are independent: each records what runs
    inside its own block.
    """

    def __init__(self, model=None):
        if model is not None and not isinstance(model, torch.nn.Module):
            raise InputTypeError(
                f"gradscope.trace(model) takes an nn.Module (or nothing), got {type(model).__name__} "
                f"{one_line(model)}. Call gradscope.trace() without arguments and pass model= to inspect()."
            )
        self._model = None if model is None else weakref.ref(unwrap(model))
        self._active = False
        self._handles: list = []
        self._mode = None
        self._reset()

    def _reset(self) -> None:
        self._calls: list[tuple[int, int]] = []  # (id(module), parent call index or -1)
        self._stack: list[int] = []  # open module calls (indices into _calls)
        self._seg_seq: list[int] = []  # segment starts (sequence numbers), ascending
        self._seg_call: list[int] = []  # innermost call of each segment, -1 outside
        self._refs: dict[int, weakref.ref] = {}  # id(module) -> weak reference
        self.leaf_refs: dict[int, int] = {}  # id(parameter) -> _torch.impl_key(parameter), filled by the mode
        self._events: list[RecordedEvent] = []  # see record_event
        self.checkpoint_params: dict[int, set] = {}  # id -> region seqs: NOTE [parameters inside reentrant checkpoint]
        self._dropped = 0
        self._joins: dict[int, list[list[int]]] = {}  # event index -> NOTE [where a cut joins]
        self.node_lines = NodeLines(_peek_seq())  # NOTE [node lines]: the user's line of every node
        self.regions = RegionRecorder(self.leaf_refs)  # NOTE [recording a reentrant region]
        self.dtypes = DtypeFlow()  # NOTE [dtype flow]
        self.batch: dict[int, list] = {}  # NOTE [the traced batch]: storage key -> [key, bytes, shape, dtype]

    # -- recording ------------------------------------------------------------------------------
    def __enter__(self) -> Trace:
        if self._active:
            raise InputValueError(
                "This gradscope.trace() is already recording; it cannot be entered twice at once. "
                "Use a second gradscope.trace() for a nested recording."
            )
        _torch.require(*_torch.TRACE_FACTS)  # one sentence when this torch moved what trace() reads
        self._reset()
        self._tid = threading.get_ident()
        self._segment(-1)
        try:
            self._handles.append(_torch.register_module_forward_pre_hook(self._pre))
            self._handles.append(_torch.register_module_forward_hook(self._post, always_call=True))
            mode = LeafMode(self)
            mode.__enter__()
            self._mode = mode
        except BaseException:
            self._remove()
            raise
        self._active = True
        return self

    def __exit__(self, *exc) -> Literal[False]:
        try:
            self._segment(-1)
            if self._mode is not None:
                self._mode.__exit__(*exc)
        finally:
            self._mode = None
            self.regions.close()
            self._stack.clear()
            self._remove()
            self._active = False
        return False

    def _remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def _segment(self, call: int) -> None:
        seq = _peek_seq()
        self.dtypes.depth(len(self._stack), call)
        starts = self._seg_seq
        if starts and starts[-1] == seq:  # the previous segment made no node: reuse it
            self._seg_call[-1] = call
        else:
            starts.append(seq)
            self._seg_call.append(call)

    def _pre(self, module, args) -> None:
        if _get_ident() != self._tid:
            return
        key = id(module)
        if key not in self._refs:
            self._refs[key] = weakref.ref(module)
        self.dtypes.buffers(module)
        stack = self._stack
        note_batch(args, self.batch, outermost=not stack)
        index = len(self._calls)
        self._calls.append((key, stack[-1] if stack else -1))
        stack.append(index)
        self._segment(index)

    def _post(self, module, args, output) -> None:
        stack = self._stack
        if not stack or _get_ident() != self._tid:
            return
        if self._calls[stack[-1]][0] != id(module):
            self._unwind(id(module))
            return
        stack.pop()
        self._segment(stack[-1] if stack else -1)

    def _unwind(self, key: int) -> None:
        # Rare: a call whose exit we never saw (its forward began before the trace did, or an exception
        # skipped the hook). Close everything above the latest open call of this module, if any.
        stack = self._stack
        for depth in range(len(stack) - 2, -1, -1):
            if self._calls[stack[depth]][0] == key:
                del stack[depth:]
                self._segment(stack[-1] if stack else -1)
                return

    # -- what the mode records (CutMode) ------------------------------------------------------------
    def full(self) -> bool:
        """True once MAX_EVENTS events are kept: later ones are only counted (:meth:`drop_event`)."""
        return len(self._events) >= MAX_EVENTS

    def drop_event(self) -> None:
        """Count an event that was not kept."""
        self._dropped += 1

    def record_event(
        self,
        kind: str,
        op: str,
        location: str | None,
        params: tuple[int, ...],
        seq: int,
        shape: list[int] | None = None,
        version: int | None = None,
        extra: dict | None = None,
    ) -> int:
        """Keep one event, inside the innermost open module call; returns its index."""
        call = self._stack[-1] if self._stack else -1
        self._events.append(RecordedEvent(kind, op, location, params, call, seq, shape, version, extra))
        return len(self._events) - 1

    def follow_event(self, index: int) -> None:
        """The result of the cut at ``index`` is followed: its joins are known (none yet)."""
        self._joins.setdefault(index, [])

    def join_event(self, index: int, seq: int, end: int) -> None:
        """An op took the cut's result at ``index`` and made the nodes ``[seq, end)`` (NOTE [where a cut joins])."""
        joins = self._joins.setdefault(index, [])
        if joins and joins[-1][1] == seq:
            joins[-1][1] = end
        elif len(joins) < 8:
            joins.append([seq, end])

    def module_key(self, module) -> int:
        """``id(module)``, remembered with a weak reference so that :meth:`annotate` can name it."""
        key = id(module)
        if key not in self._refs:
            self._refs[key] = weakref.ref(module)
        return key

    def relabel_event(self, index: int, kind: str, op: str) -> None:
        """Change what the event at ``index`` is reported as (a detach made for ``.numpy()``).

        Its result went on as a Python value, which no node takes: where it joined is not known."""
        self._events[index] = self._events[index]._replace(kind=kind, op=op)
        self._joins.pop(index, None)

    @property
    def events(self) -> list[dict]:
        """The recorded events as dicts (see :meth:`annotate`), named with the model given to ``trace``."""
        return event_dicts(
            self._events,
            self._joins,
            self._refs,
            self._names(None),
            self._param_names(None, None),
            self._live_map(None),
        )

    @property
    def calls(self) -> list[str | None]:
        """Qualified names of the module calls, in call order (None where the name is unknown)."""
        names = self._names(None)
        return [names[i] for i in range(len(self._calls))]

    def annotate(self, graph, model=None, names=None) -> None:
        """Write module names and events into ``graph`` (called by :func:`gradscope.inspect`).

        Sets the ``module`` attribute of every op node (and ``location`` where the line is known),
        ``graph.graph[EVENTS]`` and, when module names are known, ``graph.graph[CALLED_MODULES]``.
        Writes plain data only.

        Args:
            graph: the metadata graph built by ``inspect``.
            model: the ``nn.Module`` given to ``inspect`` (else the one given to ``trace``) for names.
            names: ``inspect``'s ``id(tensor) -> (name, tensor)`` parameter mapping, if any.

        Raises:
            InputValueError: the trace is still recording, never recorded, or recorded another forward
                pass (no node of ``graph`` was created inside it).
        """
        if self._active:
            raise InputValueError(
                "inspect(..., trace=tr) was called inside the `with gradscope.trace() as tr:` block; "
                "call it after the block ends so the recording is complete."
            )
        if not self._seg_seq:
            raise InputValueError(
                "inspect(..., trace=tr) got a trace that never recorded: use it as "
                "`with gradscope.trace() as tr: loss = ...` before passing it to inspect()."
            )
        ops = [
            d
            for _, d in graph.nodes(data=True)
            if d.get("kind") == "op" and d.get("seq") is not None and d["seq"] != _U64_MAX
        ]
        first, end = self._seg_seq[0], self._seg_seq[-1]
        if ops and not any(first <= d["seq"] < end for d in ops):
            raise InputValueError(
                f"inspect(..., trace=tr) got a trace of another forward pass: none of the {len(ops)} "
                "autograd nodes behind this loss was created inside its `with gradscope.trace()` block. "
                "Compute the loss inside the block you pass as trace=."
            )
        live = self._live_map(model)
        call_names = self._names(model, live)
        starts, op_calls = self._seg_seq, []
        for data in ops:
            i = bisect_right(starts, data["seq"]) - 1
            op_calls.append((data["seq"], self._seg_call[i] if i >= 0 else -1))
            data["module"] = call_names.get(op_calls[-1][1])
        self.node_lines.annotate(ops)
        pnames = self._param_names(model, names)
        graph.graph[EVENTS] = event_dicts(self._events, self._joins, self._refs, call_names, pnames, live)
        self.regions.annotate(ops, pnames, graph.graph.get(PARAMS) or {})
        annotate_dtypes(self.dtypes, graph)
        graph.graph[CHECKPOINT_PARAMS] = {
            pnames[p]: sorted(s) for p, s in self.checkpoint_params.items() if p in pnames
        }
        if model is not None or self._live_model() is not None:
            called = {call_names[i] for i in range(len(self._calls))} - {None}
            graph.graph[CALLED_MODULES] = sorted(c for c in called if c is not None)
            graph.graph[MODULE_CALLS] = module_calls(self._calls, self._refs, live, op_calls)
        if self._dropped:
            graph.graph[EVENTS_DROPPED] = self._dropped
        annotate_batch(self.batch, graph)

    def _live_model(self):
        return None if self._model is None else self._model()

    def _names(self, model, live=None) -> dict[int, str | None]:
        """call index -> qualified name of the innermost named module of that call (-1 -> None)."""
        return call_names(self._calls, self._refs, self._live_map(model) if live is None else live)

    def _live_map(self, model) -> dict:
        return live_modules(unwrap(model) if model is not None else self._live_model())

    def _param_names(self, model, names) -> dict[int, str]:
        model = unwrap(model) if model is not None else self._live_model()
        tensors: dict[int, tuple[str, torch.Tensor]] = {}
        if names:
            tensors.update(names)
        if model is not None:
            for item in model.named_parameters():
                if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
                    tensors.setdefault(id(item[1]), (str(item[0]), item[1]))
        out = {}
        for key, impl in self.leaf_refs.items():
            entry = tensors.get(key)  # the same object and TensorImpl: a parameter swapped since
            if entry is not None and _torch.impl_key(entry[1]) == impl:  # (swap_tensors) loses its name
                out[key] = entry[0]
        return out

    def __repr__(self) -> str:
        state = "recording" if self._active else "finished"
        return (
            f"<gradscope.trace: {state}, {len(self._calls)} module calls, {len(self._events)} events"
            f"{f', {self._dropped} dropped' if self._dropped else ''}>"
        )
