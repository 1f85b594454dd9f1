"""Read-only views over the walk's compact records that the compiled :class:`~gradscope.memory.replay.engine.Program`
hands out (NOTE [compiling from the compact records] in :mod:`gradscope.memory.replay.compile`): a list made on
first use, a node's contract dict built when read, and what the checkpoint-region reader and the holder count
read of a graph, answered from the columns.
"""

from __future__ import annotations

import json
import marshal
from collections.abc import Callable, Sequence

from gradscope.graph import ROOTS
from gradscope.memory.kernels.facts import slots_of

__all__ = ["Lazy", "NodeAttrs", "RegionView", "GraphAttrs"]

_NEGATIVE = (0).__gt__


class Lazy(Sequence):
    """A read-only list computed on first use (``make() -> list``); compares equal to the list."""

    __slots__ = ("_make", "_items")

    def __init__(self, make: Callable[[], list]) -> None:
        self._make: Callable[[], list] | None = make
        self._items: list | None = None

    def _get(self) -> list:
        if self._items is None:
            assert self._make is not None
            self._items, self._make = list(self._make()), None
        return self._items

    def __getitem__(self, i):
        return self._get()[i]

    def __len__(self) -> int:
        return len(self._get())

    def __iter__(self):
        return iter(self._get())

    def __eq__(self, other) -> bool:
        return self._get() == (list(other) if isinstance(other, Sequence) else other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._get())


class NodeAttrs(Sequence):
    """``Program.attrs`` over compact records: node ``i``'s contract dict, built when it is read; and the
    node facts of ``memory/kernels/facts.py`` (NOTE [node facts]) read from the columns, no dict built."""

    __slots__ = ("_records", "_slots")

    def __init__(self, records) -> None:
        self._records = records
        self._slots: dict = {}

    def __getitem__(self, i):
        return self._records.node_attrs(i)

    def __len__(self) -> int:
        return len(self._records)

    def raw_key(self, i: int):
        """A digest of op ``i``'s own part of its in-node signature from the columns (op, custom Function,
        saved slots with shapes, dtypes, devices, strides and wrapped scalars, saved values, outputs), or
        None (a node whose dict is read): equal digests give equal parts. The values as marshal's bytes,
        which tell ``2`` from ``2.0`` (their JSON text where marshal cannot write them)."""
        r = self._records
        rec = r.saved[i]
        if type(rec) is list or i in r._dicts or i in r.leaves:
            return None
        vals = r.values[i]
        vkey: bytes | str
        try:
            vkey = marshal.dumps(vals, 2)  # version 2: no back-references, so equal values give equal bytes
        except ValueError:
            vkey = json.dumps(r.saved_values(i), sort_keys=True)
        strided = r.strides.get(i)
        t = r.types[i]
        return (
            t.name,
            t.function,
            rec[0::5],
            rec[1::5],
            rec[2::5],
            rec[3::5],
            tuple(map(_NEGATIVE, rec[4::5])),  # a wrapped scalar
            None if strided is None else tuple((k, tuple(v)) for k, v in strided.items()),
            vkey,
            r.outs[i],  # (device, output shapes, output dtypes)
        )

    def slots(self, i: int) -> list:
        """Node ``i``'s saved slots as ``(slot, shape, stride, dtype, scalar, status)`` (NOTE [node facts])."""
        got = self._slots.get(i)
        if got is not None:
            return got
        r = self._records
        d = r._dicts.get(i)
        rec = r.saved[i]
        if d is not None or type(rec) is list:
            got = slots_of(d["saved"] if d is not None else rec)
        else:
            strided = r.strides.get(i) or {}
            got = [
                (rec[k], rec[k + 1], strided.get(rec[k]), rec[k + 2], rec[k + 4] < 0, "live")
                for k in range(0, len(rec), 5)
            ]
        self._slots[i] = got
        return got

    def values(self, i: int) -> dict:
        """Node ``i``'s saved values (its dict's ``attrs``)."""
        r = self._records
        d = r._dicts.get(i)
        if d is not None:
            return d.get("attrs") or {}
        return {} if i in r.leaves else r.saved_values(i)

    def outputs(self, i: int) -> tuple:
        """``(output shapes, output dtypes)`` of node ``i`` (empty for a leaf)."""
        r = self._records
        d = r._dicts.get(i)
        if d is not None:
            return d.get("out_shapes") or (), d.get("out_dtypes") or ()
        if i in r.leaves:
            return (), ()
        out = r.outs[i]
        return out[1], out[2]

    def function(self, i: int):
        """Node ``i``'s custom Function (its dict's ``function``), or None."""
        r = self._records
        d = r._dicts.get(i)
        if d is not None:
            return d.get("function")
        return None if i in r.leaves else r.types[i].function

    def dtype(self, i: int, k: int) -> str:
        """The dtype of node ``i``'s output ``k`` (a leaf's own dtype; float32 when not recorded)."""
        r = self._records
        d = r._dicts.get(i)
        leaf = r.leaves.get(i)
        if leaf is not None:
            return (leaf[4] if d is None else d.get("dtype")) or "float32"
        dts = r.outs[i][2] if d is None else d.get("out_dtypes") or ()
        return dts[k] if k < len(dts) and dts[k] else "float32"

    def structure(self) -> tuple:
        """What every node's dict and the program's edges and roots are read from: ``(types, outs, saved,
        values, strides, leaves, roots, kid_off, kids, kid_out, graph roots)``, the records' own columns
        (read-only; NOTE [signature reuse])."""
        r = self._records
        roots = list(r.graph.get(ROOTS) or ())
        return r.types, r.outs, r.saved, r.values, r.strides, r.leaves, r.roots, r.kid_off, r.kids, r.kid_out, roots

    def built(self, i: int) -> dict | None:
        """The dict of node ``i`` when something already built it (a trace annotates every op), else None."""
        return self._records._dicts.get(i)

    def built_dicts(self) -> dict:
        """``{node index: dict}`` of the dicts already built (read-only)."""
        return self._records._dicts


class RegionView:
    """What ``regions.recorded_regions`` reads of a graph, answered from the records: ``nodes.items()``
    over the nodes the general reader read (only they can hold recomputed slots), ``nodes[nid]`` any
    node's dict, ``_pred[nid]`` its inputs as ``{input id: {"output": k, "index": position}}`` (as the
    DiGraph's ``pred``)."""

    __slots__ = ("nodes", "_pred")

    def __init__(self, records, ids: list, index: dict) -> None:
        self.nodes = _ViewNodes(records, ids, index)
        self._pred = _ViewPred(records, ids, index)


class _ViewNodes:
    __slots__ = ("_r", "_ids", "_index")

    def __init__(self, records, ids, index) -> None:
        self._r, self._ids, self._index = records, ids, index

    def __getitem__(self, nid) -> dict:
        return self._r.node_attrs(self._index[nid])

    def brief(self, nid) -> dict:
        """What the region reader reads of a node that holds no slot of it: ``kind``, ``name`` and ``shape``
        or ``out_shapes`` as its dict has them (the dict itself when built; no dict is built for it)."""
        r = self._r
        i = self._index[nid]
        d = r._dicts.get(i)
        if d is not None:
            return d
        leaf = r.leaves.get(i)
        if leaf is not None:
            return {"kind": leaf[0], "name": leaf[1], "shape": None if leaf[3] is None else list(leaf[3])}
        return {
            "kind": "op",
            "name": r.types[i].name,
            "out_shapes": [None if s is None else list(s) for s in r.outs[i][1]],
        }

    def items(self) -> list:
        return [(self._ids[i], self._r.node_attrs(i)) for i in sorted(self._r.special)]


class _ViewPred:
    __slots__ = ("_r", "_ids", "_index")

    def __init__(self, records, ids, index) -> None:
        self._r, self._ids, self._index = records, ids, index

    def __getitem__(self, nid) -> dict:
        r, i = self._r, self._index[nid]
        out: dict = {}
        for k in range(r.kid_off[i], r.kid_off[i + 1]):
            u = r.kids[k]
            if u >= 0 and self._ids[u] not in out:
                out[self._ids[u]] = {"output": r.kid_out[k], "index": k - r.kid_off[i]}
        return out


class GraphAttrs:
    """What ``holders.external_storages`` reads of a graph: ``graph.graph``."""

    __slots__ = ("graph",)

    def __init__(self, graph: dict) -> None:
        self.graph = graph
