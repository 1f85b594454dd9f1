"""The compact graph: what the checks and ``summary()`` ask of ``report.graph``, answered from the walk's
:class:`~gradscope.walk.records.Records` without building the ``networkx.DiGraph`` (NOTE [compact records]).
"""

from __future__ import annotations

from gradscope.walk.records import Records, node_id, node_ids, node_index

__all__ = ["CompactGraph"]


class _Nodes:
    """``graph.nodes`` of a :class:`CompactGraph`: ``nodes[nid]``, ``nodes(data=...)``, iteration."""

    __slots__ = ("_r",)

    def __init__(self, records: Records) -> None:
        self._r = records

    def __getitem__(self, nid) -> dict:
        i = node_index(nid)
        if i is None or i >= len(self._r):
            raise KeyError(nid)
        return self._r.node_attrs(i)

    def __contains__(self, nid) -> bool:
        i = node_index(nid)
        return i is not None and i < len(self._r)

    def __len__(self) -> int:
        return len(self._r)

    def __iter__(self):
        return (node_id(i) for i in range(len(self._r)))

    def __call__(self, data=False, default=None):
        r = self._r
        n = len(r)
        if data is False:
            return node_ids(n)
        if data is True:
            return [(node_id(i), r.node_attrs(i)) for i in range(n)]
        if data == "kind" and not r._dicts:
            return [(node_id(i), r.kind(i)) for i in range(n)]
        if data == "saved_bytes" and not r._dicts:
            held, leaves = r.held, r.leaves
            return [(node_id(i), 0 if i in leaves else held[i]) for i in range(n)]
        if data == "name" and not r._dicts:
            return [(node_id(i), r.name(i)) for i in range(n)]
        if data in ("function", "seq") and not r._dicts:
            leaves, types, seqs = r.leaves, r.types, r.seqs
            if data == "seq":
                return [(node_id(i), None if i in leaves else seqs[i]) for i in range(n)]
            return [(node_id(i), None if i in leaves else types[i].function) for i in range(n)]
        if data == "module" and not r._dicts:  # op modules are None until trace() annotates
            leaves = r.leaves
            return [(node_id(i), leaves[i][2] if i in leaves else None) for i in range(n)]
        return [(node_id(i), r.node_attrs(i).get(data, default)) for i in range(n)]

    def items(self):
        return self(data=True)

    def values(self):
        return [d for _, d in self(data=True)]

    def keys(self):
        return self()


class CompactGraph:
    """The part of the DiGraph API the checks and ``summary()`` use, answered from :class:`Records`.

    ``graph.graph`` is the graph-attribute dict (the same object the DiGraph gets), ``graph.nodes[nid]``
    the node's attribute dict (the same object the DiGraph gets), ``graph.nodes(data=...)``,
    ``nid in graph``, ``len(graph)``, ``number_of_nodes()``. Any other attribute is looked up on the
    DiGraph, which is built then (once). ``compact`` is the :class:`Records`.
    """

    __slots__ = ("compact", "nodes", "graph")

    def __init__(self, records: Records) -> None:
        self.compact = records
        self.nodes = _Nodes(records)
        self.graph = records.graph

    def __contains__(self, nid) -> bool:
        return nid in self.nodes

    def __len__(self) -> int:
        return len(self.compact)

    def __iter__(self):
        return iter(self.nodes)

    def number_of_nodes(self) -> int:
        return len(self.compact)

    def __getattr__(self, name):
        if name.startswith("__") or name in CompactGraph.__slots__:  # copy/pickle probing: no DiGraph
            raise AttributeError(name)
        return getattr(self.compact.digraph(), name)
