"""Storages backward cannot free, read from the graph (see NOTE [holder counts] in ``walk/holders.py``)."""

from __future__ import annotations

from gradscope.graph import EXTERNAL, PARAMS

__all__ = ["external_storages"]


def external_storages(graph) -> set:
    """Storage keys (``("s", sid)``) held outside the graph: parameters, leaves, tensors the user holds."""
    out = {("s", sid) for sid in graph.graph.get(EXTERNAL, ())}
    for p in graph.graph.get(PARAMS, {}).values():
        if p.get("storage") is not None:
            out.add(("s", p["storage"]))
    return out
