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
    if slot == "result":
        return f"its output ('{slot}')"
    if slot.startswith("result"):
        return f"one of its outputs ('{slot}')"
    return f"its input '{slot}'"


def _matching_event(events, data, slot):
    # Prefer an in-place event recorded on a tensor of this shape after the node was created.
    seq = data.get("seq")
    best = None
    for ev in events:
        if ev.get("shape") is not None and list(ev["shape"]) != list(slot["shape"] or ()):
            continue
        if seq is not None and ev.get("seq") is not None and ev["seq"] < seq:
            continue
        best = ev
        break
    return best
