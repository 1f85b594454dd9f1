"""The walk's inner loop: every node visited once, its metadata read into compact records.

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
from operator import attrgetter
from typing import Any

import torch

from gradscope.walk.holders import _FAST_REFS, getrefcount, note_base, storage_uses
from gradscope.walk.outputs import OUT_SLOT
from gradscope.walk.records import Records, node_id
from gradscope.walk.saved import (
    _DEVICES,
    HELD,
    StorageIds,
    device_str,
    node_type,
    plain_value,
    read_saved,
)
from gradscope.walk.values import DTYPES as _DTYPES
from gradscope.walk.values import dtype_str

__all__ = ["walk"]

# Private torch APIs the walk uses (to move into gradscope/_torch.py): the SavedTensor type, and on
# nodes ``_raw_saved_*`` / ``_saved_*``, ``_input_metadata``, ``_sequence_nr()``, ``next_functions``;
# on storages ``_cdata`` (the StorageImpl pointer).
_SavedTensor = torch._C._autograd.SavedTensor
_SCALAR_DTYPES = frozenset((torch.float64, torch.int64, torch.complex128, torch.bool))
_STORAGE_ERRORS = (RuntimeError, NotImplementedError, TypeError)

_OP, _LEAF, _OTHER = 0, 1, 2
_SPECS: dict = {}  # node class -> (code, name, tensor slots, value slots, NodeType, vget, one value, out slot)
_SHAPES: dict = {}  # interned shapes and output-shape tuples (plain tuples of ints: no tensor kept)
_MAX_SHAPES = 1 << 16
#: interned ``(device, out_shapes, out_dtypes)`` of op nodes (NOTE [compact records]), keyed by what
#: ``_input_metadata`` gave (torch objects) or by what a saved slot gave (strings): no tensor kept
_OUTS: dict = {}
_SLOT_OUTS: dict = {}
_NO_OUT = (None, (), ())


def _spec(node) -> tuple:
    info = node_type(node)
    code = _LEAF if info.leaf else (_OTHER if info.custom else _OP)
    attrs = [attr for _, attr in info.value_slots]
    # all value slots in one C call: a tuple, or the value itself for one slot (NOTE [compact records])
    vget = attrgetter(*attrs) if attrs else None
    out_slot = OUT_SLOT.get(info.name) if code == _OP else None
    if out_slot is not None and out_slot not in {s for s, _, _ in info.tensor_slots}:
        out_slot = None
    spec = _SPECS[type(node)] = (
        code,
        info.name,
        info.tensor_slots,
        info.value_slots,
        info,
        vget,
        len(attrs) == 1,
        out_slot,
    )
    return spec


def _value(node, attr):
    try:
        return getattr(node, attr)
    except RuntimeError:
        return None


#: Types of saved values kept as read (NOTE [compact records]): they hold no tensor; the records turn
#: them into the contract's plain values (negative ints, lists) when a node's dict is built.
_RAW_OK = frozenset((int, tuple, float, bool, type(None), str))


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
        storages: the walk's :class:`~gradscope.walk.saved.StorageIds`.
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
    leaves, special, param_nodes = r.leaves, r.special, r.param_nodes
    held_sids: set = set()
    held_add = held_sids.add
    held_extra = 0
    sids_get = storages.ids.get
    sids = storages.ids
    sizes = storages.sizes
    new_size = sizes.append
    new_use = storages.uses.append
    impls = storages.impls
    impls_get = impls.get
    specs_get = _SPECS.get
    names_get = names.get
    dtypes_get = _DTYPES.get
    devices_get = _DEVICES.get
    small = len(_SHAPES) + len(_OUTS) + len(_SLOT_OUTS) < _MAX_SHAPES
    shapes = _SHAPES if small else {}
    shape_get = shapes.get
    outs = _OUTS if small else {}
    outs_get = outs.get
    slot_outs = _SLOT_OUTS if small else {}
    slot_outs_get = slot_outs.get
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
        visit(nexts)
        for child, _ in reversed(nexts):
            if child not in ids:
                push(child)
        spec = specs_get(type(node))
        if spec is None:
            spec = _spec(node)
        code = spec[0]
        types_add(spec[4])
        if code == _LEAF:
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
            seqs_add(0)
            held_col(0)
            saved_add(())
            values_add(None)
            outs_add(_NO_OUT)
            continue
        # -- saved tensors: NOTE [walk fast path] ------------------------------------------------------
        held = 0
        out = None  # the outputs, when a saved slot gives them: NOTE [outputs from a saved slot]
        ok = fast and code == _OP
        if ok:
            rec: tuple = ()  # () + t is t itself: no copy for the common single slot
            node_sids = None
            out_slot = spec[7]
            for s, raw_attr, attr in spec[2]:
                try:
                    raw = getattr(node, raw_attr)
                except RuntimeError:
                    ok = False
                    break
                # the SavedTensor stub lacks the real ``unpack_hook`` and ``data`` properties
                if type(raw) is not _SavedTensor or raw.unpack_hook is not None:  # type: ignore[attr-defined]
                    ok = False
                    break
                data = raw.data  # type: ignore[attr-defined]  # stub lacks it (see above)
                if data is None:
                    try:  # never saved (an optional input, or one that needs no gradient) unless it raises
                        if getattr(node, attr) is None:
                            continue
                    except RuntimeError:
                        pass
                    ok = False
                    break
                version = data._version
                if version:
                    try:  # written in place at some point: stale only if reading the slot raises
                        getattr(node, attr)
                    except RuntimeError:
                        ok = False
                        break
                try:
                    st = data.untyped_storage()
                    ptr = st._cdata
                    shape = data.shape
                    key = data._cdata
                except _STORAGE_ERRORS:  # no plain storage, or a nested tensor: the general reader
                    ok = False
                    break
                sid = sids_get(ptr)
                if sid is None:
                    sid = sids[ptr] = len(sizes)
                    new_size(st.nbytes())
                    new_use(storage_uses(ptr) - 1)
                # the holder count, inline: NOTE [holder counts] (holders.note_impl)
                extra = getrefcount(data) - _FAST_REFS
                hrec = impls_get(key)
                if hrec is None:
                    try:
                        hrec = impls[key] = [sid, data._use_count() - 1, extra, 1, 0]
                        if data._is_view():
                            note_base(impls, data, sid)
                    except (AttributeError, RuntimeError):
                        pass
                else:
                    hrec[3] += 1
                    if extra > hrec[2]:
                        hrec[2] = extra
                    if hrec[3] == 1 and data._is_view():  # first seen as a view's base
                        note_base(impls, data, sid)
                dt = data.dtype
                dev = data.device
                canon = shape_get(shape)
                if canon is None:
                    canon = shapes[shape] = shape
                dtype = dtypes_get(dt) or dtype_str(dt)
                device = devices_get(dev) or device_str(dev)
                if s == out_slot and not version:
                    okey = (device, canon, dtype)
                    out = slot_outs_get(okey)
                    if out is None:
                        out = slot_outs[okey] = (device, (canon,), (dtype,))
                if not shape and dt in _SCALAR_DTYPES and dev.type == "cpu" and not data.requires_grad:
                    # a wrapped Python number: not an activation (saved._is_wrapped_scalar); ~sid marks it
                    rec += (s, canon, dtype, device, ~sid)
                    continue
                rec += (s, canon, dtype, device, sid)
                held_add(sid)
                if node_sids is None:
                    node_sids = [sid]
                    held = sizes[sid]
                elif sid not in node_sids:
                    node_sids.append(sid)
                    held += sizes[sid]
            if ok:
                vget = spec[5]
                values: Any
                if vget is None:
                    values = ()
                elif spec[6]:  # one value slot: the value itself
                    try:
                        values = vget(node)
                    except RuntimeError:
                        values = None
                    if type(values) not in _RAW_OK:
                        values = plain_value(values)
                else:
                    try:  # raw values: plain Python data (ints, int tuples, floats, bools, None, str)
                        values = vget(node)
                    except RuntimeError:
                        values = tuple(_value(node, attr) for _, attr in spec[3])
                    if not _RAW_OK.issuperset(map(type, values)):
                        values = tuple(map(plain_value, values))
                saved_add(rec)
                values_add(values)
        if not ok:
            data = None  # the fast path's reference would read as a holder outside the graph
            out = None
            saved, values = read_saved(node, spec[4], storages)
            if fast and code == _OP and rec:  # slots the fast path counted before it gave up: counted twice
                _uncount(node, spec[2], len(rec) // 5, impls)
            held = 0
            seen = set()
            for e in saved:
                if e["status"] in HELD and "scalar" not in e:
                    sid = e["storage"]
                    if sid is None:
                        held += e["nbytes"]
                        held_extra += e["nbytes"]
                    elif sid not in seen:
                        seen.add(sid)
                        held_add(sid)
                        held += e["nbytes"]
            special.append(i)
            saved_add(saved)
            values_add(values)
        held_col(held)
        seqs_add(node._sequence_nr())
        if out is not None:
            outs_add(out)
            continue
        try:
            meta = node._input_metadata
        except (AttributeError, RuntimeError):
            meta = ()
        if len(meta) == 1:
            m = meta[0]
            dev = m.device
            dt = m.dtype
            try:
                okey = (dev, tuple(m.shape), dt)
            except RuntimeError:  # a nested tensor
                okey = (dev, None, dt)
            out = outs_get(okey)
            if out is None:
                out = outs[okey] = (devices_get(dev) or device_str(dev), (okey[1],),
                                    (dtypes_get(dt) or dtype_str(dt),))  # fmt: skip
            outs_add(out)
        elif meta:
            dev = meta[0].device
            okey = (devices_get(dev) or device_str(dev), _out_shapes(meta),
                    tuple(dtypes_get(m.dtype) or dtype_str(m.dtype) for m in meta))  # fmt: skip
            outs_add(slot_outs.setdefault(okey, okey))
        else:
            outs_add(_NO_OUT)
    _edges(r, ids, nexts_of)
    r.seqs = array("Q", seqs)
    r.held = array("q", held_of)
    r.held_total = held_extra + sum(sizes[s] for s in held_sids)
    r.sizes = sizes
    del ids[None]  # the sentinel; the other keys are the nodes, root-first
    return r, ids


def _uncount(node, slots, n: int, impls: dict) -> None:
    """Undo the holder count (NOTE [holder counts]) of the first ``n`` saved tensors of ``node``: the fast
    path counted them before a later slot sent the node to the general reader, which counted them again."""
    for _, raw_attr, _ in slots:
        if n <= 0:
            return
        data = getattr(node, raw_attr).data
        if data is not None:
            n -= 1
            rec = impls.get(data._cdata)
            if rec is not None and rec[3] > 1:
                rec[3] -= 1


def _edges(r: Records, ids: dict, nexts_of: list) -> None:
    """Fill the edge columns (child index or -1, output number) in ``next_functions`` order."""
    # array(typecode, list) converts in C; array.extend(iterable) costs ~10x more per element
    r.kid_off = array("q", list(accumulate(map(len, nexts_of), initial=0)))
    r.kids = array("q", [ids[child] for nexts in nexts_of for child, _ in nexts])
    r.kid_out = array("q", [out_nr for nexts in nexts_of for _, out_nr in nexts])
