"""``inplace-hazard``: a tensor saved for backward was modified in place afterwards."""

from __future__ import annotations

from collections.abc import Iterator

from gradscope.checks._nodes import node_items
from gradscope.findings import Finding
from gradscope.graph import EVENTS

__all__ = ["check", "stale_savers"]


def check(graph, nodes=None) -> Iterator[Finding]:
    """One error per stale tensor, at the first node that saved it, with the in-place op when traced.

    A tensor saved by several nodes (sigmoid's output, also saved as the next matmul's input) is one
    cause: it gives one finding at the earliest saver that names the others.
    """
    events = [e for e in graph.graph.get(EVENTS, ()) if e["kind"] == "inplace"]
    groups: dict = {}
    for nid, data in node_items(graph, nodes):
        stale = [e for e in data["saved"] if e["status"] == "stale"]
        if stale:
            key = stale[0]["storage"] if stale[0]["storage"] is not None else ("node", nid)
            groups.setdefault(key, []).append((nid, data, stale))
    for savers in groups.values():
        savers.sort(key=lambda s: (s[1].get("seq") is None, s[1].get("seq") or 0))
        nid, data, stale = savers[0]
        e = stale[0]
        what = _what(data["name"], e["slot"])
        if len(stale) > 1:
            what += " (also " + ", ".join(f"'{s['slot']}'" for s in stale[1:]) + ")"
        also = ""
        if len(savers) > 1:
            others = ", ".join(f"{d['name']} ({n}, '{st[0]['slot']}')" for n, d, st in savers[1:4])
            more = f" and {len(savers) - 4} more" if len(savers) > 4 else ""
            also = f" The same tensor is also saved by {others}{more}."
        event = _matching_event(events, data, e)
        where = f" by {event['op']} at {event['location']}" if event else ""
        loc = event["location"] if event else None
        op = event["op"] if event else ""
        if op.endswith("_") and not op.endswith("__"):
            fix = f"Use the out-of-place {op[:-1]}() instead of {op}() there"
        else:
            fix = "Use the out-of-place op (x = x.mul(2) instead of x.mul_(2); inplace=False on the module)"
        yield Finding(
            "inplace-hazard", "error",
            f"{data['name']} saved {what} (shape {tuple(e['shape'])}, {e['dtype']}) at "
            f"{'an earlier version' if e['saved_version'] is None else 'version ' + str(e['saved_version'])}"
            f", but it was modified in place{where} and is now at version "
            f"{e['version']}: backward() will raise 'modified by an inplace operation'.{also} {fix}, "
            f"or .clone() the tensor before modifying it.",
            node=nid, location=loc)


def stale_savers(graph, nid) -> list[str]:
    """Every node that saved the same stale tensor as ``nid`` (``nid`` first): what one finding stands for."""
    keys = {e["storage"] for e in graph.nodes[nid]["saved"] if e["status"] == "stale"} - {None}
    if not keys:
        return [nid]
    others = [n for n, d in graph.nodes(data=True) if n != nid
              and any(e["status"] == "stale" and e["storage"] in keys for e in d["saved"])]
    return [nid, *others]


def _what(name: str, slot: str) -> str:
    if slot.startswith("checkpoint input"):
        return f"its checkpoint region's {slot.removeprefix('checkpoint ')} (kept to recompute the region)"
    if slot == "result":
        return f"its output ('{slot}')"
    if slot.startswith("result"):
        return f"one of its outputs ('{slot}')"
    return f"its input '{slot}'"


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
            continue    # event seq is the next number after the write: the node must be older
        v = ev.get("version")
        if v is not None and saved_v is not None and now_v is not None and not saved_v < v <= now_v:
            continue
        (same if ev.get("shape") is None or list(ev["shape"]) == shape else other).append(ev)
    for group in (same, other):
        if group:
            return min(group, key=lambda ev: (ev.get("version") or 0, ev.get("seq") or 0))
    return None
