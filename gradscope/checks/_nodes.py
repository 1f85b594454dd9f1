"""Which nodes a check has to look at."""

from __future__ import annotations

__all__ = ["node_items"]


def node_items(graph, nodes=None):
    """``(id, attrs)`` of ``nodes`` (ids in graph order), or of every node when ``nodes`` is None.

    ``inspect`` passes the nodes its walk did not read on the fast path (NOTE [walk fast path] in
    ``walk/loop.py``): only those can hold a stale, freed or opaque slot or be an opaque region, so checks
    that look for those need not scan the whole graph.
    """
    if nodes is None:
        return graph.nodes(data=True)
    data = graph.nodes
    return [(n, data[n]) for n in nodes]
