"""The replay's program compiled straight from the walk's compact records (no DiGraph, no node dicts), and
:func:`program`, a report's program kept in ``report.cache``.

NOTE [compiling from the compact records]
``inspect()`` returns a report whose graph is still in the compact columns of ``walk/records.py``
(NOTE [compact records]); building the ``networkx.DiGraph`` and a dict per node costs more than the
replay itself. :func:`compile_records` reads the columns instead and gives the same :class:`Program` as
``engine.compile_graph(report.graph)``, field by field (``tests/memory/test_backward_memory_compact.py`` checks
it on every model): edges grouped per target in order of first use (as the DiGraph's ``pred`` lists
them), the saved storage keys of each node, gradient sizes from the output shapes. What the numbers do
not need is made on first use: ``Program.attrs`` builds a node's dict when it is read, ``Program.module``
runs the module inference over the DiGraph only when a module name is asked for. Non-reentrant
checkpoint regions (``regions.py``) read the nodes the general reader read and their inputs through
:class:`~gradscope.memory.replay.columns.RegionView`.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import compress, islice

from gradscope.graph import PARAMS, ROOT_SHAPES, ROOTS
from gradscope.graph.attribution import node_modules
from gradscope.memory.kernels import reuse
from gradscope.memory.replay.columns import GraphAttrs, Lazy, NodeAttrs, RegionView
from gradscope.memory.replay.dtypes import numel_bytes
from gradscope.memory.replay.engine import Program, compile_graph, node_dtype, slot_keys
from gradscope.memory.replay.holders import external_storages

__all__ = ["compile_records", "program", "PROGRAM_KEY", "Lazy", "NodeAttrs"]

_UINT64_MAX = (1 << 64) - 1
_FLOATS = ("float", "bfloat", "complex")


def _grouped(kids, kid_out, start: int, end: int) -> tuple[list, list]:
    """Edges grouped per target in order of first use, as the DiGraph's ``pred`` lists them."""
    groups: dict = {}
    for k in range(start, end):
        u = kids[k]
        if u >= 0:
            g = groups.get(u)
            if g is None:
                groups[u] = [k - start, kid_out[k]]
            else:
                g.append(kid_out[k])
    es, pos = [], []
    for u, g in groups.items():
        first = g[0]
        for j, out in enumerate(g[1:]):
            es.append((u, out))
            pos.append(first + j)
    return es, pos


_ALPHA_AT: dict = {}  # a node type's value slots -> the position of its alpha slot (-1: none); for every walk
_GRADS: dict = {}  # (output shapes, dtypes) -> (shapes as lists, bytes per output), for every walk; read-only


def _grads(o, dts) -> tuple[list, list]:
    """The gradient shapes and bytes of outputs ``o`` with dtypes ``dts`` (one dtype per output), shared by
    every program (nothing changes them)."""
    try:
        hit = _GRADS.get((o, dts))
    except TypeError:  # an unhashable shape: computed each time
        return _sizes(o, dts)
    if hit is None:
        if len(_GRADS) >= 4096:
            _GRADS.clear()
        hit = _GRADS[(o, dts)] = _sizes(o, dts)
    return hit


def _sizes(o, dts, default: str | None = None) -> tuple[list, list]:
    """Shapes as lists and bytes per output (``default``: the dtype of outputs ``dts`` does not name)."""
    shapes = [None if sh is None else list(sh) for sh in o]
    return shapes, [numel_bytes(sh, dts[k] if k < len(dts) else default) for k, sh in enumerate(shapes)]


def _extras(records, leaf: list, extra: dict) -> list:
    """Fill ``extra`` with what the replay reads of the ops' values (the dict of an op the general reader
    read, ``{"alpha": a}`` of a fast-path op with an alpha slot); returns the same per node (None for the
    others: ``engine.node_extras``)."""
    types, values = records.types, records.values
    per_node: list = [None] * len(types)
    alpha_at = _ALPHA_AT
    for i, t in enumerate(types):
        if leaf[i]:
            continue
        vals = values[i]
        if type(vals) is dict:
            if vals:
                extra[i] = per_node[i] = vals
            continue
        slots = t.value_slots
        at = alpha_at.get(slots)
        if at is None:
            at = alpha_at[slots] = next((j for j, (slot, _) in enumerate(slots) if slot == "alpha"), -1)
        if at >= 0:
            extra[i] = per_node[i] = {"alpha": vals if len(slots) == 1 else vals[at]}
    return per_node


def _has_regions(records) -> bool:
    for i in records.special:
        rec = records.saved[i]
        if type(rec) is list and any(e.get("status") == "recomputed" for e in rec):
            return True
    return False


def _edges(n: int, off: list, kids: list, kid_out: list) -> tuple[list, list]:
    """Each node's edges ``(target, output)`` grouped per target, and the positions that need a gradient."""
    edges: list = [()] * n
    needs: list = [()] * n
    for i, start, end in zip(range(n), off, islice(off, 1, None)):  # the edges
        d = end - start
        if not d:
            continue
        if d == 1:  # one edge (most nodes), two distinct ones, or the general grouping
            u = kids[start]
            if u >= 0:
                edges[i], needs[i] = [(u, kid_out[start])], [0]
        elif d == 2 and kids[start] != kids[start + 1] and kids[start] >= 0 and kids[start + 1] >= 0:
            edges[i], needs[i] = [(kids[start], kid_out[start]), (kids[start + 1], kid_out[start + 1])], [0, 1]
        else:
            ks = kids[start:end]
            if min(ks) >= 0 and len(set(ks)) == d:  # distinct targets: nothing to group
                edges[i], needs[i] = list(zip(ks, kid_out[start:end])), list(range(d))
            else:
                edges[i], needs[i] = _grouped(kids, kid_out, start, end)
    return edges, needs


def _saved(records, rsaved, leaf: list, ids: list, sizes) -> tuple[list, dict, dict]:
    """Each op's saved storage keys, and every key's bytes and shape."""
    saved: list = [()] * len(leaf)
    storages: dict = {}
    shapes: dict = {}
    for i in compress(range(len(leaf)), rsaved):  # the saved storages of each op
        if leaf[i]:
            continue
        rec = rsaved[i]
        if type(rec) is list:
            saved[i] = slot_keys(rec, ids[i], storages, shapes)
            continue
        if len(rec) == 5:  # one saved tensor (most ops)
            sid = rec[4]
            if sid >= 0:  # else a wrapped Python scalar
                key = ("s", sid)
                saved[i] = (key,)
                if key not in storages:
                    storages[key] = sizes[sid]
                    shapes[key] = list(rec[1])
            continue
        keys: list = []
        for sid, shp in zip(rec[4::5], rec[1::5]):
            if sid < 0:
                continue  # a wrapped Python scalar
            key = ("s", sid)
            if key not in storages:
                storages[key] = sizes[sid]
                shapes[key] = list(shp)
            if key not in keys:
                keys.append(key)
        saved[i] = tuple(keys)
    return saved, storages, shapes


def _structural(records, ids: list) -> tuple:
    """What :func:`compile_records` reads from the records' structure alone (NOTE [signature reuse]: equal for
    graphs of one structure): names, leaves, edges, gradient shapes and bytes, the ops' values, the saved
    keys and shapes with the recorded checkpoint regions written in, and the storages those regions add."""
    n = len(records)
    leaves, types = records.leaves, records.types
    off, kids, kid_out = records.kid_off.tolist(), records.kids.tolist(), records.kid_out.tolist()  # faster to index
    name = [t.name for t in types]  # a leaf's type is AccumulateGrad's
    leaf = [False] * n
    for i in leaves:
        leaf[i] = True
    gshapes: list = [None] * n
    gbytes: list = [None] * n
    by_entry: dict = {}
    for i, ent in enumerate(records.outs):
        hit = by_entry.get(id(ent))
        if hit is None:
            o, dts = ent[1], ent[2]
            if len(dts) < len(o):
                hit = _sizes(o, dts, node_dtype({"saved": records.saved_dicts(i)}))
            else:
                hit = by_entry[id(ent)] = _grads(o, dts)
        gshapes[i], gbytes[i] = hit
    leaf_info: dict = {}
    for i, lf in leaves.items():
        sh = [] if lf[3] is None else list(lf[3])
        gshapes[i] = [sh]
        gbytes[i] = [numel_bytes(sh, lf[4])]
        leaf_info[i] = (lf[0], lf[1])
    extra: dict = {}  # what the replay reads of ``attrs`` (alpha, the reentrant checkpoint's region)
    edges, needs = _edges(n, off, kids, kid_out)
    saved, storages, shapes = _saved(records, records.saved, leaf, ids, records.sizes)
    per_node = _extras(records, leaf, extra)
    index = dict(zip(ids, range(n)))
    regions, recompute, added = {}, {}, {}
    if _has_regions(records):  # NOTE [recorded checkpoint regions]
        from gradscope.memory.replay.regions import recorded_regions

        before = set(storages)
        regions, recompute = recorded_regions(RegionView(records, ids, index), index, saved, storages, shapes)
        added = {k: b for k, b in storages.items() if k not in before}  # the regions' keys, in their order
    return (
        name,
        leaf,
        gshapes,
        gbytes,
        leaf_info,
        edges,
        needs,
        extra,
        per_node,
        index,
        saved,
        shapes,
        regions,
        recompute,
        added,
        storages,
    )


def compile_records(records, ids: list, modules: Callable[[], dict], shared: dict | None = None):
    """The :class:`~gradscope.memory.engine.Program` of ``records``.

    ``ids`` are the node ids (``list(compact_graph.nodes)``); ``modules()`` returns ``{node id: module}``
    (``graph.node_modules``), called on first use only. ``shared``: the dict of the records' structure
    (``reuse.shared``), whose structural part of the program (:func:`_structural`) is made once.
    """
    leaves, types = records.leaves, records.types
    gattrs = records.graph
    params = gattrs.get(PARAMS, {})
    parts = None if shared is None else shared.get("program")
    if parts is None:
        parts = _structural(records, ids)
        storages = parts[-1]
        if shared is not None:
            shared["program"] = parts[:-1]
    else:  # the storages' bytes are this walk's; the regions' own keys as the structure's
        storages = _saved(records, records.saved, parts[1], ids, records.sizes)[1]
        storages.update(parts[14])
    name, leaf, gshapes, gbytes, leaf_info, edges, needs, extra, per_node, index, saved, shapes, regions = parts[:13]
    recompute = parts[13]
    seq: list = records.seqs.tolist()
    has_grad: dict = {}
    for i, lf in leaves.items():
        seq[i] = _UINT64_MAX
        grad = lf[7]
        if grad is None and lf[0] == "param":
            grad = params.get(lf[1], {}).get("grad")
        has_grad[i] = bool(grad)
    opaque = Lazy(lambda: [bool(t.opaque) and not leaf[i] for i, t in enumerate(types)])
    roots = [index[r] for r in gattrs.get(ROOTS, ()) if r in index]
    root_bytes = []
    for r, shape in zip(roots, gattrs.get(ROOT_SHAPES, ())):
        dts = records.outs[r][2] if r not in leaves else ()
        root_bytes.append(numel_bytes(shape, dts[0] if dts else node_dtype(records.node_attrs(r))))
    module = Lazy(lambda: [leaves[i][2] if leaf[i] else m.get(nid) for m in (modules(),) for i, nid in enumerate(ids)])
    prog = Program(
        ids=ids,
        index=index,
        name=name,
        seq=seq,
        leaf=leaf,
        edges=edges,
        grad_bytes=gbytes,
        grad_shapes=gshapes,
        saved=saved,
        storages=storages,
        shapes=shapes,
        external=external_storages(GraphAttrs(gattrs)),
        has_grad=has_grad,
        roots=roots,
        root_bytes=root_bytes,
        module=module,  # type: ignore[arg-type]
        attrs=NodeAttrs(records),  # type: ignore[arg-type]
        regions=regions,
        recompute=recompute,
        opaque=opaque,  # type: ignore[arg-type]
        needs=needs,
        extra=extra,
        leaf_info=leaf_info,
    )
    prog.__dict__["_extras"] = per_node  # what engine.node_extras would make from ``extra``
    return prog


#: The key of the compiled program in ``report.cache``: ``(the graph or records it was compiled from, Program)``.
PROGRAM_KEY = "memory.replay.program"


def program(report) -> Program:
    """The compiled graph of ``report`` (kept in ``report.cache``; the graph is not changed)."""
    cache = getattr(report, "cache", None)
    cached = None if cache is None else cache.get(PROGRAM_KEY)
    view = report.peek_graph() if hasattr(report, "peek_graph") else report.graph
    records = getattr(view, "compact", None)
    if cached is not None and (cached[0] is view or cached[0] is records or getattr(cached[0], "_digraph", 0) is view):
        return cached[1]  # the same graph, or the DiGraph built since from the records it was compiled from
    prog = None
    if records is not None:  # NOTE [compiling from the compact records]
        shared = reuse.shared(NodeAttrs(records).structure())  # NOTE [signature reuse]
        prog = compile_records(records, view.nodes(), lambda: node_modules(report.graph), shared)
        prog.__dict__["_derived"] = shared
    if prog is None:
        records, prog = None, compile_graph(report.graph)
    if cache is not None:
        cache[PROGRAM_KEY] = (records if records is not None else report.graph, prog)
    return prog
