"""Storages backward cannot free, read from the graph (see NOTE [holder counts] in ``walk/holders.py``)."""

from __future__ import annotations

__all__ = ["external_storages"]


def external_storages(graph) -> set:
    """Storage keys (``("s", sid)``) held outside the graph: parameters, leaves, tensors the user holds."""
    out = {("s", sid) for sid in graph.graph.get("external", ())}
    for p in graph.graph.get("params", {}).values():
        if p.get("storage") is not None:
            out.add(("s", p["storage"]))
    return out
