"""The events a trace records (cuts and in-place writes) and the plain dicts ``graph.graph["events"]`` holds."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["RecordedEvent", "event_dicts"]


class RecordedEvent(NamedTuple):
    """One cut or in-place write as the mode records it: ids and numbers only, named in ``Trace.annotate``."""

    kind: str  # "detach", ".data", "no_grad-region", "to-python", ..., "inplace"
    op: str  # the torch function, e.g. "detach", "add_"
    location: str | None  # the user's "file.py:LINE"
    params: tuple[int, ...]  # ids of the parameters that fed the cut input (see leaf_refs)
    call: int  # the innermost open module call (index into _calls), -1 outside
    seq: int  # the next sequence number when it was recorded
    shape: list[int] | None  # in-place: the written tensor's shape
    version: int | None  # in-place: its version after the write
    extra: dict | None = None  # more keys for the event dict ("producer", "region", "optimizer", ...)


def event_dicts(events, joins, refs, call_names, param_names, live) -> list[dict]:
    """The events as dicts (schema ``TraceEvent``), with names: ``call_names`` (call index -> module),
    ``param_names`` (id -> parameter), ``live`` (id -> (name, module)) checked against the weak ``refs``;
    ``joins``: event index -> NOTE [where a cut joins]."""
    out = []
    for index, (kind, op, location, params, call, seq, shape, version, extra) in enumerate(events):
        ev = {
            "kind": kind,
            "op": op,
            "location": location,
            "params": sorted({param_names[p] for p in params if p in param_names}),
            "module": call_names.get(call),
            "seq": seq,
            "shape": shape,
        }
        if version is not None:
            ev["version"] = version
        if extra:  # "producer" (NOTE [in-place inside reentrant checkpoint]), "optimizer"
            ev.update(extra)
            key = ev.pop("hook_module_id", None)
            if key is not None:  # NOTE [cuts in forward hooks]
                entry, ref = live.get(key), refs.get(key)
                named = entry is not None and ref is not None and ref() is entry[1]
                ev["hook_module"] = (entry[0] or None) if named else None
        followed = joins.get(index)
        if followed is not None:
            ev["joins"] = [list(j) for j in followed]
        out.append(ev)
    return out
