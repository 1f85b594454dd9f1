"""``inplace-hazard``: a tensor saved for backward was modified in place afterwards."""

from __future__ import annotations

from collections.abc import Iterator

from gradscope.checks._nodes import node_items
from gradscope.checks._words import fix_words, op_words, tensor_words
from gradscope.findings import ERROR, INPLACE_HAZARD, Finding
from gradscope.graph import EVENTS, ROOTS

__all__ = ["check", "stale_savers"]


def check(graph, nodes=None) -> Iterator[Finding]:
    """One error per stale tensor, at the first node that saved it, with the in-place op when traced.

    A tensor saved by several nodes (sigmoid's output, also saved as the next matmul's input) is one
    cause: it gives one finding at the earliest saver that names the others.
    """
    events = [e for e in graph.graph.get(EVENTS, ()) if e["kind"] == "inplace"]
    yield from _in_reentrant_checkpoint(graph, events)
    reported: set = set()
    for f in _hidden_by_slice(graph, events):  # traced: the slice write and the later one, named
        reported.add(f.node)
        yield f
    groups: dict = {}
    for nid, data in node_items(graph, nodes):
        stale = [e for e in data["saved"] if e["status"] == "stale"]
        if stale and nid not in reported:
            key = stale[0]["storage"] if stale[0]["storage"] is not None else ("node", nid)
            groups.setdefault(key, []).append((nid, data, stale))
    for savers in groups.values():
        savers.sort(key=lambda s: (s[1].get("seq") is None, s[1].get("seq") or 0))
        nid, data, stale = savers[0]
        e = stale[0]
        what = tensor_words(graph, nid, e)
        if len(stale) > 1:
            what += f" (and {len(stale) - 1} more of its saved tensors)"
        also = ""
        if len(savers) > 1:
            others = ", ".join(f"{op_words(d['name'])}{_in(d)} ({n})" for n, d, st in savers[1:4])
            more = f" and {len(savers) - 4} more" if len(savers) > 4 else ""
            also = f" The same tensor is also saved by {others}{more}."
        event = _matching_event(events, data, e)
        where = f" by {event['op']} at {event['location']}" if event else ""
        loc = event["location"] if event else None
        fix = fix_words(event["op"], bool(event.get("optimizer"))) if event else fix_words("")
        view = e["saved_version"] is None
        said = (
            "'... is a view and its base ... has been modified inplace'"
            if view
            else "'modified by an inplace operation'"
        )
        writer_fixes = event and (event.get("optimizer") or "max_norm" in event["op"])
        clone = "" if writer_fixes else _CLONE
        yield Finding(
            INPLACE_HAZARD,
            ERROR,
            f"{op_words(data['name'])}{_in(data)} ({nid}) saved {what} (shape {tuple(e['shape'])}, "
            f"{e['dtype']}) for backward at {'an earlier version' if view else 'version ' + str(e['saved_version'])}"
            f", but it was modified in place{where} and is now at version {e['version']}: backward() will "
            f"raise {said}.{also} To fix, {fix}{clone}.",
            node=nid,
            location=loc,
        )


def _in_reentrant_checkpoint(graph, events) -> Iterator[Finding]:
    """In-place writes inside a reentrant checkpoint body that its recomputation in backward() trips over.

    See NOTE [in-place inside reentrant checkpoint] in tracing/modes.py: the trace names the op that made
    the written tensor, and that op saves its own output when the region is re-run with grad enabled.
    """
    if not any(ev.get("producer") for ev in events):
        return
    seqs = dict(graph.nodes(data="seq"))
    regions = sorted(
        ((seqs[n] or 0, n) for n, f in graph.nodes(data="function") if (f or "").endswith(".CheckpointFunction")),
        reverse=True,
    )
    for ev in events:
        producer = ev.get("producer")
        if not producer or not regions:
            continue
        node = next((n for seq, n in regions if seq == ev.get("region")), None)
        if node is None:  # the region is not in this graph: its inputs need no grad
            continue
        op = ev["op"]
        fix = fix_words(op)
        inside = f" (in {ev['module']})" if ev.get("module") else ""
        yield Finding(
            INPLACE_HAZARD,
            ERROR,
            f"{op} at {ev.get('location') or 'an unknown location'} writes in place the output of "
            f"{producer}() inside a reentrant checkpoint region{inside}. backward() re-runs that region with "
            f"grad enabled; {producer} then saves its output for its own gradient, the write changes it, "
            f"and backward() raises 'modified by an inplace operation'. To fix, {fix} or write "
            "checkpoint(..., use_reentrant=False).",
            node=node,
            location=ev.get("location"),
        )


_SAVES_RESULT_INPLACE = frozenset({"sigmoid_", "tanh_", "exp_", "relu_", "sqrt_", "rsqrt_", "exp2_"})


def _hidden_by_slice(graph, events) -> Iterator[Finding]:
    """An in-place op on a slice that saved its own result, then another write (NOTE [in-place on a slice])."""
    if not any(e.get("view") and e["op"] in _SAVES_RESULT_INPLACE for e in events):
        return
    seqs = dict(graph.nodes(data="seq"))
    copies = {seqs[n]: n for n, name in graph.nodes(data="name") if name == "CopySlices"}
    if not copies:
        return
    roots = [graph.nodes[r].get("seq") for r in graph.graph.get(ROOTS, ())]
    last = max((s for s in roots if s is not None), default=None)
    for i, first in enumerate(events):
        if not (first.get("view") and first["op"] in _SAVES_RESULT_INPLACE and first.get("seq") is not None):
            continue
        made = [s for s in copies if s is not None and first["seq"] - 3 <= s < first["seq"]]
        if not made:  # the CopySlices made by this very write (and its SigmoidBackward inside it)
            continue
        nid = copies[max(made)]
        later = next(
            (
                e
                for e in events[i + 1 :]
                if e.get("storage") == first.get("storage")
                and (e.get("version") or 0) > (first.get("version") or 0)
                and (last is None or e.get("seq") is None or e["seq"] <= last + 1)
            ),
            None,
        )
        if later is None:
            continue
        op = first["op"]
        yield Finding(
            INPLACE_HAZARD,
            ERROR,
            f"{op} at {first.get('location') or 'an unknown location'} wrote a slice in place and saved its "
            f"result for backward (hidden inside CopySlices, {nid}); then {later['op']} at "
            f"{later.get('location') or 'an unknown location'} wrote the same tensor again, so that saved "
            "result is stale: backward() will raise 'modified by an inplace operation'. To fix, compute the "
            f"slice out of place (x[:, :k] = x[:, :k].{op[:-1]}() or torch.cat), or {fix_words(later['op'])}.",
            node=nid,
            location=later.get("location"),
        )


def stale_savers(graph, nid) -> list[str]:
    """Every node that saved the same stale tensor as ``nid`` (``nid`` first): what one finding stands for."""
    keys = {e["storage"] for e in graph.nodes[nid]["saved"] if e["status"] == "stale"} - {None}
    if not keys:
        return [nid]
    others = [
        n
        for n, d in graph.nodes(data=True)
        if n != nid and any(e["status"] == "stale" and e["storage"] in keys for e in d["saved"])
    ]
    return [nid, *others]


_CLONE = ", or .clone() the tensor before modifying it"


def _in(d) -> str:
    return f" in {d['module']}" if d.get("module") else ""


def _matching_event(events, data, slot):
    """The recorded in-place event that made ``slot`` stale, or None.

    A candidate was recorded after the node was created (its ``seq`` is above the node's) and, when versions
    are known, left the tensor at a version in ``(saved_version, version]``; among those the earliest write
    wins (it is the one that broke the slot). Same shape first; a write through a view of another shape
    comes second.
    """
    seq = data.get("seq")
    saved_v, now_v = slot.get("saved_version"), slot.get("version")
    shape = list(slot.get("shape") or ())
    same: list[dict] = []
    other: list[dict] = []
    for ev in events:
        if seq is not None and ev.get("seq") is not None and ev["seq"] <= seq:
            continue  # event seq is the next number after the write: the node must be older
        v = ev.get("version")
        if v is not None and saved_v is not None and now_v is not None and not saved_v < v <= now_v:
            continue
        (same if ev.get("shape") is None or list(ev["shape"]) == shape else other).append(ev)
    for group in (same, other):
        if group:
            return min(group, key=lambda ev: (ev.get("version") or 0, ev.get("seq") or 0))
    return None
