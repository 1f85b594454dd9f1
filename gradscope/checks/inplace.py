"""``inplace-hazard``: a tensor saved for backward was modified in place afterwards."""

from __future__ import annotations

from collections.abc import Iterator

from ..finding import Finding

__all__ = ["check"]


def check(graph) -> Iterator[Finding]:
    """One error per node holding stale saved tensors, with the in-place op's location when traced."""
    events = [e for e in graph.graph.get("events", ()) if e["kind"] == "inplace"]
    for nid, data in graph.nodes(data=True):
        stale = [e for e in data["saved"] if e["status"] == "stale"]
        if not stale:
            continue
        e = stale[0]
        what = _what(data["name"], e["slot"])
        if len(stale) > 1:
            what += " (also " + ", ".join(f"'{s['slot']}'" for s in stale[1:]) + ", the same tensor)" \
                if len({s["storage"] for s in stale}) == 1 else \
                " (also " + ", ".join(f"'{s['slot']}'" for s in stale[1:]) + ")"
        event = _matching_event(events, data, e)
        where = f" by {event['op']} at {event['location']}" if event else ""
        loc = event["location"] if event else None
        yield Finding(
            "inplace-hazard", "error",
            f"{data['name']} saved {what} (shape {tuple(e['shape'])}, {e['dtype']}) at version "
            f"{e['saved_version']}, but it was modified in place{where} and is now at version "
            f"{e['version']}: backward() will raise 'modified by an inplace operation'. Use the "
            f"out-of-place op (x = x.mul(2) instead of x.mul_(2); inplace=False on the module), or "
            f".clone() before modifying it.",
            node=nid, location=loc)


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

    A candidate was recorded after the node was created (its ``seq`` is above the node's) and, when versions are known, left the
    tensor at a version in ``(saved_version, version]``; among those the earliest write wins (it is the
    one that broke the slot). Same shape first; a write through a view of another shape comes second.
    """
    seq = data.get("seq")
    saved_v, now_v = slot.get("saved_version"), slot.get("version")
    shape = list(slot.get("shape") or ())
    same, other = [], []
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
