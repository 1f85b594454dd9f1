"""The walk's compact result, and the ``networkx.DiGraph`` of the contract built from it on demand.

NOTE [compact records]
``inspect()`` keeps what the walk read in flat columns, one entry per node index ``i`` (node id
``"n{i}"``), not in a dict per node, slot and edge: a dict costs ~3x the memory of the values it holds,
and building hundreds of thousands of them is most of the walk's time and all of the collector's work.

    types[i]    the node's ``saved.NodeType`` (name, slot names, custom/opaque flags), shared per class
    seqs[i]     ``_sequence_nr()`` (unused for leaves)        held[i]  saved bytes, each storage once
    outs[i]     ``(device string or None, output shapes, output dtype strings)``, interned (one tuple
                shared by every node with the same outputs); ``(None, (), ())`` for leaves
    saved[i]    a fast-path op: a flat tuple, 5 entries per slot ``(slot, shape, dtype, device, sid)``,
                status "live", ``nbytes = sizes[sid]``, ``sid < 0`` marks a wrapped scalar (``~sid``);
                any other node: the list of slot dicts that ``saved.read_saved`` returned
    values[i]   a fast-path op: the raw saved values, a tuple aligned with ``types[i].value_slots`` (the
                value itself when there is one slot; plain Python data that ``values.plain_value`` turns
                into the contract's values); any other op: the dict ``read_saved`` returned
    leaves      ``i -> (kind, name, module, shape, dtype, requires_grad, device, grad)`` for AccumulateGrad
                nodes (``grad``: the leaf's ``.grad`` was already set)
    kid_off / kids / kid_out   the edges: node ``i`` consumed ``kids[k]`` (index, -1 for None) output
                ``kid_out[k]`` for ``k`` in ``kid_off[i]:kid_off[i+1]``, in ``next_functions`` order
Shapes are stored as ``torch.Size`` (a plain tuple) and interned; lists are made only when a node's
attribute dict is built (:meth:`Records.node_attrs`), which gives exactly the dict the contract
documents. :class:`CompactGraph` answers what the checks and ``summary()`` ask of a graph from these
columns (``compact.py``); anything else builds the DiGraph (:meth:`Records.digraph`) once and asks it.
"""

from __future__ import annotations

from array import array
from typing import Any

import networkx as nx

from gradscope.walk.values import plain_value

__all__ = ["Records", "node_id", "node_ids", "node_index"]

_IDS: list[str] = []  # "n0", "n1", ...: the same strings in every walk
_MAX_CACHED_IDS = 1 << 18


def node_id(i: int) -> str:
    """``3 -> "n3"`` (cached strings for the first 256k indices)."""
    if i < len(_IDS):
        return _IDS[i]
    if i < _MAX_CACHED_IDS:
        _IDS.extend(f"n{k}" for k in range(len(_IDS), min(max(2 * i, 1024), _MAX_CACHED_IDS)))
        return _IDS[i]
    return f"n{i}"


def node_ids(n: int) -> list[str]:
    """``["n0", ..., f"n{n - 1}"]``: one slice of the cached strings."""
    if 0 < n <= _MAX_CACHED_IDS:
        node_id(n - 1)  # the cache then holds the first n ids
        return _IDS[:n]
    return [node_id(i) for i in range(n)]


def node_index(nid) -> int | None:
    if type(nid) is str and nid[:1] == "n" and nid[1:].isdigit():
        return int(nid[1:])
    return None


class Records:
    """The compact form of one walk (see NOTE [compact records])."""

    __slots__ = (
        "types",
        "seqs",
        "held",
        "saved",
        "values",
        "outs",
        "leaves",
        "kid_off",
        "kids",
        "kid_out",
        "sizes",
        "graph",
        "roots",
        "special",
        "param_nodes",
        "held_total",
        "strides",
        "storage_ptrs",
        "_dicts",
        "_digraph",
        "__weakref__",
    )

    def __init__(self) -> None:
        self.types: list = []
        self.seqs = array("Q")
        self.held = array("q")
        self.saved: list = []
        self.values: list = []
        self.outs: list = []
        self.leaves: dict = {}
        self.kid_off = array("q", [0])
        self.kids = array("q")
        self.kid_out = array("q")
        self.sizes: list[int] = []  # storage id -> storage bytes
        self.graph: dict = {}  # the DiGraph's graph attributes (roots, params, ...)
        self.roots: list[int] = []
        self.special: list[int] = []  # nodes read by the general reader (NOTE [walk fast path])
        self.param_nodes: dict = {}  # parameter name -> node id
        self.held_total = 0
        self.strides: dict = {}  # node index -> {slot: strides} of its non-contiguous saved tensors (fast path)
        self.storage_ptrs: dict = {}  # StorageImpl pointer -> storage id (build.py's _storage_ptrs)
        self._dicts: dict = {}  # node index -> attribute dict already handed out
        self._digraph = None

    def __len__(self) -> int:
        return len(self.types)

    # -- one node ------------------------------------------------------------------------------------
    def node_attrs(self, i: int) -> dict:
        """The attribute dict of node ``i``, exactly as the contract documents it (cached: one object)."""
        d = self._dicts.get(i)
        if d is None:
            d = self._dicts[i] = self._make_attrs(i)
        return d

    def _make_attrs(self, i: int) -> dict:
        root = i in self.roots
        leaf = self.leaves.get(i)
        if leaf is not None:
            kind, name, module, shape, dtype, requires_grad, device, grad = leaf
            return {
                "kind": kind,
                "name": name,
                "saved": [],
                "saved_bytes": 0,
                "module": module,
                "root": root,
                "opaque": False,
                "seq": None,
                "shape": None if shape is None else list(shape),
                "dtype": dtype,
                "requires_grad": requires_grad,
                "device": device,
                "grad": grad,
            }
        t = self.types[i]
        device, shapes, dtypes = self.outs[i]
        d = {
            "kind": "op",
            "name": t.name,
            "saved": self.saved_dicts(i),
            "saved_bytes": self.held[i],
            "device": device,
            "module": None,
            "root": root,
            "opaque": t.opaque,
            "seq": self.seqs[i],
            "attrs": self.saved_values(i),
            "out_shapes": [None if s is None else list(s) for s in shapes],
            "out_dtypes": list(dtypes),
        }
        if t.function is not None:
            d["function"] = t.function
        return d

    def saved_dicts(self, i: int) -> list[dict]:
        """Node ``i``'s saved slots as the contract's dicts (the cached node's own list once built)."""
        d = self._dicts.get(i)
        if d is not None:
            return d["saved"]
        rec = self.saved[i]
        if type(rec) is list:
            return rec
        sizes = self.sizes
        strided = self.strides.get(i)
        out = []
        for k in range(0, len(rec), 5):
            sid = rec[k + 4]
            scalar = sid < 0
            if scalar:
                sid = ~sid
            e = {
                "slot": rec[k],
                "shape": list(rec[k + 1]),
                "dtype": rec[k + 2],
                "device": rec[k + 3],
                "nbytes": sizes[sid],
                "status": "live",
                "storage": sid,
            }
            if scalar:
                e["scalar"] = True
            if strided is not None and rec[k] in strided:
                e["stride"] = strided[rec[k]]
            out.append(e)
        return out

    def saved_values(self, i: int) -> dict:
        """Node ``i``'s saved values as its dict's ``attrs`` (plain values; made afresh for a fast-path op)."""
        vals = self.values[i]
        if type(vals) is dict:
            return vals
        slots = self.types[i].value_slots
        if len(slots) == 1:  # one value slot: the value itself
            return {slots[0][0]: plain_value(vals)}
        return {s: plain_value(v) for (s, _), v in zip(slots, vals)}

    def n_slots(self, i: int) -> int:
        d = self._dicts.get(i)
        if d is not None:
            return len(d["saved"])
        rec = self.saved[i]
        return len(rec) if type(rec) is list else len(rec) // 5

    def n_slots_total(self) -> int:
        """The number of saved-slot entries over all nodes (what ``summary()`` counts)."""
        if self._dicts:
            return sum(self.n_slots(i) for i in range(len(self.types)))
        return sum(len(rec) if type(rec) is list else len(rec) // 5 for rec in self.saved)

    def kind(self, i: int) -> str:
        leaf = self.leaves.get(i)
        return "op" if leaf is None else leaf[0]

    def name(self, i: int) -> str:
        leaf = self.leaves.get(i)
        return self.types[i].name if leaf is None else leaf[1]

    # -- the DiGraph ---------------------------------------------------------------------------------
    def digraph(self) -> nx.DiGraph:
        """The ``networkx.DiGraph`` of the contract, built on first use and then always the same object."""
        g = self._digraph
        if g is None:
            g = self._digraph = self._build()
        return g

    def _build(self) -> nx.DiGraph:
        n = len(self.types)
        ids = node_ids(n)
        g = nx.DiGraph()
        g.graph = self.graph
        # NOTE [building the DiGraph]: nodes and edges are inserted through networkx's own dicts (the
        # documented data structure of DiGraph: _node, _succ/_adj, _pred, one attr dict shared by succ and
        # pred) because add_node/add_edge cost more than the whole walk. tests/walk/test_inspect_graph.py
        # checks that the result behaves as a normal DiGraph.
        attrs = self.node_attrs
        g._node.update((ids[i], attrs(i)) for i in range(n))
        # per node: neighbour id -> edge attributes {"index", "output", "count"} (ints), and "outputs" (a
        # list of ints) when the edge carries several outputs
        succ: list[dict[str, dict[str, Any]]] = [{} for _ in range(n)]
        pred: list[dict[str, dict[str, Any]]] = [{} for _ in range(n)]
        off, kids, outs = self.kid_off, self.kids, self.kid_out
        for v in range(n - 1, -1, -1):  # consumers last-discovered first, inputs by index
            into = pred[v]
            vid = ids[v]
            start = off[v]
            for k in range(start, off[v + 1]):
                u = kids[k]
                if u < 0:
                    continue
                uid = ids[u]
                e = into.get(uid)
                if e is None:
                    succ[u][vid] = into[uid] = {"index": k - start, "output": outs[k], "count": 1}
                else:
                    e["count"] += 1
                    out_nr = outs[k]
                    if out_nr != e["output"] or "outputs" in e:  # several outputs of u: the replay needs each
                        e.setdefault("outputs", [e["output"]] * (e["count"] - 1)).append(out_nr)
        g._succ.update(zip(ids, succ))
        g._pred.update(zip(ids, pred))
        return g
