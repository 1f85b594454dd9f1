"""Non-reentrant checkpoint regions the graph already has, turned into the replay's recompute lists.

NOTE [recorded checkpoint regions]
Under ``checkpoint(fn, *args, use_reentrant=False)`` each slot a region's op saved is a ``_Holder``; the
walk reads the frame's own record of the packed tensor's shape and dtype (``walk/checkpoint.py``
``holder_meta``: ``entry["recompute"]``). At the region's first unpack in backward, the forward re-runs
and re-creates those tensors; each lives until the last region node holding it has run. Several slots
can hold one tensor (``relu``'s result saved by the next ``addmm``), so slots are matched to the tensor
they hold: a ``result*`` slot is its node's output, an input slot is the output of the edge target whose
shape it has. What is not re-created: tensors that come from outside the region (the region input, which
the frame keeps in its saved ``args``, parameters and views of them). The frame's inputs are held by every
node of the region (the frame lives as long as any of its holders).
"""

from __future__ import annotations

from gradscope.memory.replay.dtypes import numel_bytes

__all__ = ["recorded_regions"]

_VIEWS = (
    "TBackward0",
    "ViewBackward0",
    "TransposeBackward0",
    "PermuteBackward0",
    "UnsqueezeBackward0",
    "SqueezeBackward0",
    "SqueezeBackward1",
    "ExpandBackward0",
    "AliasBackward0",
)

#: The input position of a binary op's saved input slot (``mul``: ``self`` is input 0, ``other`` input 1).
_POSITIONS = {"self": 0, "other": 1}


class _ReadOnce(dict):
    """``pred[nid]`` read from the graph once per node (the compact records' view makes a dict per read)."""

    __slots__ = ("_read",)

    def __init__(self, read) -> None:
        super().__init__()
        self._read = read

    def __missing__(self, nid):
        got = self[nid] = self._read[nid]
        return got


def _from_param(node, u, pred) -> bool:
    d = node(u)
    while d.get("kind") == "op" and d.get("name") in _VIEWS and len(pred[u]) == 1:
        u = next(iter(pred[u]))
        d = node(u)
    return d.get("kind") == "param"


def _out_shape(d: dict, k: int):
    if d.get("kind") != "op":
        return d.get("shape")
    outs = d.get("out_shapes") or []
    return outs[k] if k < len(outs) else None


def recorded_regions(graph, index: dict, saved: list, storages: dict, shapes: dict):
    """``(regions, recompute)`` for the replay; ``saved``/``storages``/``shapes`` are updated in place.

    ``regions``: region key -> node indices; ``recompute``: node index -> ``[(key, bytes)]`` (every node
    of a region lists the region's tensors: whichever runs first creates them).
    """
    nodes = graph.nodes
    node = getattr(nodes, "brief", None) or nodes.__getitem__  # kind, name and shapes of any node
    pred = _ReadOnce(getattr(graph, "_pred", None) or graph.pred)
    members: dict = {}
    slots: dict = {}
    for nid, d in nodes.items():
        for e in d.get("saved") or ():
            meta = e.get("recompute")
            if e.get("status") == "recomputed" and meta:
                members.setdefault(meta["region"], set()).add(nid)
                slots.setdefault(meta["region"], []).append((nid, e, meta))
    if not members:
        return {}, {}
    regions, recompute = {}, {}
    for r, nids in members.items():
        rkey = ("ck", r)
        inside = set(nids)
        frame_keys = []
        for nid in nids:  # the frame's saved args: listed on one node of the region by the walk
            for e in nodes[nid].get("saved") or ():
                if str(e.get("slot", "")).startswith("checkpoint input") and e.get("storage") is not None:
                    frame_keys.append(("s", e["storage"]))
        extra = max((m.get("frame_bytes") or 0 for _, _, m in slots[r]), default=0)
        if extra:  # the RNG states the frame keeps: alive since the forward, freed with the frame
            storages[("f", rkey)] = extra
            shapes[("f", rkey)] = None
            frame_keys.append(("f", rkey))
        fresh: dict = {}
        holds: dict = {nid: [] for nid in nids}
        for nid, e, meta in slots[r]:
            if meta.get("shape") is None:
                continue
            slot = str(e.get("slot", ""))
            shape = meta["shape"]
            source: tuple[object, int | str] | None = None  # (node, output nr or slot name)
            if slot.startswith("result"):
                k = slot[len("result") :]
                source = (nid, int(k) if k.isdigit() else 0)
            else:
                cands = [
                    (u, ed.get("output", 0))
                    for u, ed in pred[nid].items()
                    if _out_shape(node(u), ed.get("output", 0)) == shape
                ]
                if any(_from_param(node, u, pred) or u not in inside for u, _ in cands):
                    continue  # a parameter (or a view of one), or the region's input: not re-created
                if len(cands) > 1 and slot in _POSITIONS:  # several inputs of that shape: the slot's own
                    cands = [c for c in cands if pred[nid][c[0]].get("index") == _POSITIONS[slot]] or cands
                if len(cands) == 1:
                    source = cands[0]
                elif not cands:
                    if any(shapes.get(k) == shape for k in frame_keys):
                        continue  # the region input, kept by the frame
                    source = (nid, slot)
                else:
                    source = (nid, slot)
            key = ("r", rkey, source)
            fresh.setdefault(key, numel_bytes(shape, meta.get("dtype")))
            if key not in holds[nid]:
                holds[nid].append(key)
        for key, nbytes in fresh.items():
            storages[key] = nbytes
            shapes.setdefault(key, None)
        listing = list(fresh.items())
        for nid in nids:
            i = index[nid]
            keys = [k for k in saved[i] if k not in frame_keys] + holds[nid] + frame_keys
            saved[i] = tuple(dict.fromkeys(keys))
            recompute[i] = listing
        regions[rkey] = {index[n] for n in nids}
    return regions, recompute
