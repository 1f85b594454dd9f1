"""The walk's inner loop: every node visited once, its metadata read into compact records.

The pieces: the per-class facts (``spec.py``: :class:`~gradscope.walk.spec.ClassSpec`), the fast reader of
a plain op (``fast.py``), the general reader of every slot state (``saved.py``), the compact records
(``records.py``) and, here, the loop with a leaf's and the outputs' readers.

NOTE [walk fast path]
``inspect()`` is meant to cost a small multiple of the bare minimum (visiting every node and reading
every saved tensor's metadata), so this loop is written for CPython's interpreter: the per-class facts
(slot attribute names, op name, whether it is a leaf) come from one cache lookup, attributes and bound
methods are local variables, and the common case of an op node whose saved slots are all plain live
tensors (no hook, never written in place, a dense storage) is read inline into the flat records of
NOTE [compact records] (``records.py``): no dict per node, slot or edge, shapes interned. A node that
leaves the fast path in any slot (hooks, freed or stale slots, lists of tensors, custom Functions,
checkpoint holders, nested tensors) is re-read whole by the general code in ``saved.py``, which registers
storages in the same order, so ids and results are those of the general code (tests/walk/test_compact.py
checks both readers against each other on every test graph). The walk also records what the checks
and the report would otherwise recompute by scanning every node: the nodes that are not plain (the only
ones that can hold a stale, freed or opaque slot or be an opaque region), the node of each named
parameter, and the saved bytes of the whole graph, each storage counted once. Where a saved slot
already gives a node's outputs, ``_input_metadata`` is not read (NOTE [outputs from a saved slot]).
"""

from __future__ import annotations

from array import array
from itertools import accumulate

from gradscope.walk.compiled import COMPILED_CUTS, cut_event, dead_inputs
from gradscope.walk.fast import fast_reader, uncount
from gradscope.walk.records import Records, node_id
from gradscope.walk.saved import read_saved
from gradscope.walk.slots import DEVICES as _DEVICES
from gradscope.walk.slots import HELD, StorageIds, device_str
from gradscope.walk.spec import LEAF, OP, SPECS, ClassSpec, class_spec, read_values
from gradscope.walk.values import DTYPES as _DTYPES
from gradscope.walk.values import dtype_str

__all__ = ["walk"]

# Private torch APIs the loop uses (to move into gradscope/_torch.py): on nodes ``_input_metadata``,
# ``_sequence_nr()``, ``next_functions``; the fast reader's are listed in fast.py.
_SHAPES: dict = {}  # interned shapes and output-shape tuples (plain tuples of ints: no tensor kept)
_MAX_SHAPES = 1 << 16
#: interned ``(device, out_shapes, out_dtypes)`` of op nodes (NOTE [compact records]), keyed by what
#: ``_input_metadata`` gave (torch objects) or by what a saved slot gave (strings): no tensor kept
_OUTS: dict = {}
_SLOT_OUTS: dict = {}
_NO_OUT = (None, (), ())


def _out_shapes(meta) -> tuple:
    """Output shapes from ``_input_metadata`` (None for a nested tensor, whose shape torch cannot give)."""
    out: list[tuple[int, ...] | None] = []
    for m in meta:
        try:
            out.append(tuple(m.shape))
        except RuntimeError:
            out.append(None)
    return tuple(out)


def walk(starts: list, names: dict, storages: StorageIds, fast: bool = True) -> tuple[Records, dict]:
    """Visit every node reachable from ``starts`` once, depth-first, in discovery order.

    Args:
        starts: the root nodes, root 0 first.
        names: ``id(tensor) -> (qualified name, tensor)`` from :func:`gradscope.walk.build.param_names`.
        storages: the walk's :class:`~gradscope.walk.slots.StorageIds`.
        fast: False reads every node with the general reader (for tests: NOTE [walk fast path]).

    Returns:
        ``(records, ids)``: the :class:`~gradscope.walk.records.Records` (node ``i`` is the ``i``-th
        discovered, id ``"n{i}"``; ``special``, ``param_nodes`` and ``held_total`` filled in) and a dict
        whose keys are the live nodes in discovery order (the caller decides how long to keep them).
    """
    r = Records()
    ids: dict = {None: -1}
    nexts_of: list = []
    visit = nexts_of.append
    seqs: list = []
    held_of: list = []  # both become arrays at the end (list.append is the cheaper one)
    types_add, seqs_add, held_col = r.types.append, seqs.append, held_of.append
    saved_add, values_add, outs_add = r.saved.append, r.values.append, r.outs.append
    special = r.special
    held_sids: set = set()
    held_add = held_sids.add
    held_extra = 0
    small = len(_SHAPES) + len(_OUTS) + len(_SLOT_OUTS) < _MAX_SHAPES
    slot_outs = _SLOT_OUTS if small else {}
    read_fast = fast_reader(storages, _SHAPES if small else {}, slot_outs, held_add, r.strides)
    read_outs = _outs_reader(_OUTS if small else {}, slot_outs)
    read_leaf = _leaf_reader(r, names)
    specs_get = SPECS.get
    n = 0
    stack = list(reversed(starts))
    pop = stack.pop
    push = stack.append
    while stack:
        node = pop()
        if node in ids:
            continue
        ids[node] = i = n
        n += 1
        nexts = node.next_functions
        spec = specs_get(type(node)) or class_spec(node)
        if spec.info.compiled:  # edges the region's backward sends no gradient along: NOTE in walk/compiled.py
            kept = dead_inputs(node, nexts)
            cut = cut_event(node, nexts, kept, names) if kept is not nexts else None
            if cut is not None:
                r.graph.setdefault(COMPILED_CUTS, []).append(cut)
            nexts = kept
        visit(nexts)
        for child, _ in reversed(nexts):
            if child not in ids:
                push(child)
        types_add(spec.info)
        if spec.code == LEAF:
            read_leaf(node, i)
            seqs_add(0)
            held_col(0)
            saved_add(())
            values_add(None)
            outs_add(_NO_OUT)
            continue
        # -- saved tensors: NOTE [walk fast path] ------------------------------------------------------
        got = read_fast(node, spec, i) if fast and spec.code == OP else 0
        if type(got) is tuple:
            rec, held, out = got
            saved_add(rec)
            values_add(read_values(node, spec))
        else:
            out = None
            if got:  # slots the fast path counted before it gave up: counted twice
                uncount(node, spec.tensor_slots, got, storages.impls)
            held, extra = _read_general(node, spec, storages, held_add, saved_add, values_add)
            held_extra += extra
            special.append(i)
        held_col(held)
        seqs_add(node._sequence_nr())
        outs_add(out if out is not None else read_outs(node))
    _edges(r, ids, nexts_of)
    r.seqs = array("Q", seqs)
    r.held = array("q", held_of)
    sizes = storages.sizes
    r.held_total = held_extra + sum(sizes[s] for s in held_sids)
    r.sizes = sizes
    del ids[None]  # the sentinel; the other keys are the nodes, root-first
    return r, ids


def _read_general(node, spec: ClassSpec, storages: StorageIds, held_add, saved_add, values_add) -> tuple[int, int]:
    """Read a node the fast path does not take with ``saved.read_saved``; return (its held bytes, the bytes
    of held slots without a storage id, which the graph's total counts one by one)."""
    saved, values = read_saved(node, spec.info, storages)
    held = extra = 0
    seen = set()
    for e in saved:
        if e["status"] in HELD and "scalar" not in e:
            sid = e["storage"]
            if sid is None:
                held += e["nbytes"]
                extra += e["nbytes"]
            elif sid not in seen:
                seen.add(sid)
                held_add(sid)
                held += e["nbytes"]
    saved_add(saved)
    values_add(values)
    return held, extra


def _leaf_reader(r: Records, names: dict):
    """The reader of an AccumulateGrad node: its leaf's record (a named parameter or an input)."""
    leaves, param_nodes = r.leaves, r.param_nodes
    names_get, dtypes_get, devices_get = names.get, _DTYPES.get, _DEVICES.get

    def read(node, i: int) -> None:
        var = node.variable
        named = names_get(id(var))
        dt = var.dtype
        dev = var.device
        try:
            shape = var.shape
        except RuntimeError:  # a nested tensor
            shape = None
        # .grad already set: backward adds into it in place (the last entry)
        dtype = dtypes_get(dt) or dtype_str(dt)
        device = devices_get(dev) or device_str(dev)
        if named:
            qual = named[0]
            param_nodes[qual] = node_id(i)  # the last one, as a dict built over the nodes
            leaves[i] = ("param", qual, qual.rpartition(".")[0] or None, shape, dtype,
                         bool(var.requires_grad), device, var.grad is not None)  # fmt: skip
        else:
            leaves[i] = ("input", "input", None, shape, dtype, bool(var.requires_grad), device,
                         var.grad is not None)  # fmt: skip

    return read


def _outs_reader(outs: dict, slot_outs: dict):
    """The reader of an op's outputs from ``_input_metadata``, interned in ``outs`` / ``slot_outs``."""
    outs_get, dtypes_get, devices_get = outs.get, _DTYPES.get, _DEVICES.get

    def read(node) -> tuple:
        try:
            meta = node._input_metadata
        except (AttributeError, RuntimeError):
            meta = ()
        if len(meta) == 1:
            m = meta[0]
            dev = m.device
            dt = m.dtype
            okey: tuple
            try:
                okey = (dev, tuple(m.shape), dt)
            except RuntimeError:  # a nested tensor
                okey = (dev, None, dt)
            out = outs_get(okey)
            if out is None:
                out = outs[okey] = (devices_get(dev) or device_str(dev), (okey[1],),
                                    (dtypes_get(dt) or dtype_str(dt),))  # fmt: skip
            return out
        if meta:
            dev = meta[0].device
            okey = (devices_get(dev) or device_str(dev), _out_shapes(meta),
                    tuple(dtypes_get(m.dtype) or dtype_str(m.dtype) for m in meta))  # fmt: skip
            return slot_outs.setdefault(okey, okey)
        return _NO_OUT

    return read


def _edges(r: Records, ids: dict, nexts_of: list) -> None:
    """Fill the edge columns (child index or -1, output number) in ``next_functions`` order."""
    # array(typecode, list) converts in C; array.extend(iterable) costs ~10x more per element
    r.kid_off = array("q", list(accumulate(map(len, nexts_of), initial=0)))
    r.kids = array("q", [ids[child] for nexts in nexts_of for child, _ in nexts])
    r.kid_out = array("q", [out_nr for nexts in nexts_of for _, out_nr in nexts])
