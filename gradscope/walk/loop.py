"""The walk's inner loop: every node visited once, its metadata read, its edges recorded.

NOTE [walk fast path]
``inspect()`` is meant to cost a small multiple of the bare minimum (visiting every node and reading
every saved tensor's metadata), so this loop is written for CPython's interpreter: the per-class facts
(slot attribute names, op name, whether it is a leaf) come from one cache lookup, attributes and bound
methods are local variables, and the common case of an op node whose saved slots are all plain live
tensors (no hook, never written in place, a dense storage) is read inline. A node that leaves the fast
path in any slot (hooks, freed or stale slots, lists of tensors, custom Functions, checkpoint holders)
is re-read whole by the general code in ``saved.py``, which registers storages in the same order, so ids
and results are those of the general code. The walk also returns what the checks and the report would
otherwise recompute by scanning every node: the nodes that are not plain (the only ones that can hold a
stale, freed or opaque slot or be an opaque region), the node of each named parameter, and the saved
bytes of the whole graph, each storage counted once.
"""

from __future__ import annotations

import torch

from gradscope.walk.holders import _FAST_REFS, getrefcount, note_impl, storage_uses
from gradscope.walk.values import _I64_MAX, _U64
from gradscope.walk.saved import HELD, _DEVICES, _DTYPES, StorageIds, device_str, dtype_str, node_type, plain_value, read_saved

__all__ = ["walk"]

_SavedTensor = torch._C._autograd.SavedTensor
_SCALAR_DTYPES = frozenset((torch.float64, torch.int64, torch.complex128, torch.bool))
_STORAGE_ERRORS = (RuntimeError, NotImplementedError, TypeError)

_OP, _LEAF, _OTHER = 0, 1, 2
_SPECS: dict = {}   # node class -> (code, name, tensor slots, value slots, NodeType)
_IDS: list[str] = []    # "n0", "n1", ...: the same strings in every walk
_MAX_CACHED_IDS = 1 << 17


def _grow_ids(n: int) -> int:
    """Make ``_IDS`` hold ``"n0" ... "n{n}"`` (up to the cap) and return its length."""
    if len(_IDS) <= n < _MAX_CACHED_IDS:
        _IDS.extend(f"n{i}" for i in range(len(_IDS), min(max(2 * n, 1024), _MAX_CACHED_IDS)))
    return len(_IDS)


def _spec(node) -> tuple:
    info = node_type(node)
    code = _LEAF if info.leaf else (_OTHER if info.custom else _OP)
    spec = _SPECS[type(node)] = (code, info.name, info.tensor_slots, info.value_slots, info)
    return spec


def walk(starts: list, names: dict, storages: StorageIds):
    """Visit every node reachable from ``starts`` once, depth-first, in discovery order.

    Args:
        starts: the root nodes, root 0 first.
        names: ``id(tensor) -> (qualified name, tensor)`` from :func:`gradscope.walk.build.param_names`.
        storages: the walk's :class:`~gradscope.walk.saved.StorageIds`.

    Returns:
        ``(ids, attrs, succ, pred, index)``: ``ids`` maps each live node to its id (``None`` maps to
        ``None``, a sentinel; the other keys are in discovery order); ``attrs``/``succ``/``pred`` are the
        DiGraph's node and adjacency dicts; ``index`` holds ``"special"`` (ids of the nodes that left the
        fast path, in discovery order), ``"param_nodes"`` (param name -> id) and ``"held"`` (saved bytes,
        each storage once). See NOTE [walk fast path].
    """
    ids: dict = {None: None}
    attrs: dict = {}
    visited: list = []      # (id, next_functions) per node, for the edges
    visit = visited.append
    special: list = []
    param_nodes: dict = {}
    held_sids: set = set()
    held_add = held_sids.add
    held_extra = 0
    sids_get = storages.ids.get
    sids = storages.ids
    sizes = storages.sizes
    new_size = sizes.append
    new_use = storages.uses.append
    impls = storages.impls
    specs_get = _SPECS.get
    names_get = names.get
    dtypes_get = _DTYPES.get
    devices_get = _DEVICES.get
    id_list = _IDS
    n_cached = _grow_ids(0)
    n = 0
    stack = list(reversed(starts))
    pop = stack.pop
    push = stack.append
    while stack:
        node = pop()
        if node in ids:
            continue
        if n == n_cached:
            n_cached = _grow_ids(n)
        nid = ids[node] = id_list[n] if n < n_cached else f"n{n}"
        n += 1
        nexts = node.next_functions
        visit((nid, nexts))
        for child, _ in reversed(nexts):
            if child not in ids:
                push(child)
        spec = specs_get(type(node))
        if spec is None:
            spec = _spec(node)
        code = spec[0]
        if code == _LEAF:
            var = node.variable
            named = names_get(id(var))
            if named:
                qual = named[0]
                param_nodes[qual] = nid  # the last one, as a dict built over the nodes
                head = qual.rpartition(".")[0] or None
                attrs[nid] = {"kind": "param", "name": qual, "saved": [], "saved_bytes": 0, "module": head,
                              "root": False, "opaque": False, "seq": None}
            else:
                attrs[nid] = {"kind": "input", "name": "input", "saved": [], "saved_bytes": 0,
                              "module": None, "root": False, "opaque": False, "seq": None}
            a = attrs[nid]
            dt = var.dtype
            dev = var.device
            a["shape"] = list(var.shape)
            a["dtype"] = dtypes_get(dt) or dtype_str(dt)
            a["requires_grad"] = bool(var.requires_grad)
            a["device"] = devices_get(dev) or device_str(dev)
            a["grad"] = var.grad is not None   # .grad already set: backward adds in place
            continue
        # -- saved tensors: NOTE [walk fast path] ------------------------------------------------------
        saved = []
        held = 0
        fast = code == _OP
        if fast:
            node_sids = None
            for s, raw_attr, attr in spec[2]:
                try:
                    raw = getattr(node, raw_attr)
                except RuntimeError:
                    fast = False
                    break
                if type(raw) is not _SavedTensor or raw.unpack_hook is not None:
                    fast = False
                    break
                data = raw.data
                if data is None:
                    try:  # never saved (an optional input, or one that needs no gradient) unless it raises
                        if getattr(node, attr) is None:
                            continue
                    except RuntimeError:
                        pass
                    fast = False
                    break
                if data._version:
                    try:  # written in place at some point: stale only if reading the slot raises
                        getattr(node, attr)
                    except RuntimeError:
                        fast = False
                        break
                try:
                    st = data.untyped_storage()
                    ptr = st._cdata
                except _STORAGE_ERRORS:
                    fast = False
                    break
                sid = sids_get(ptr)
                if sid is None:
                    sid = sids[ptr] = len(sizes)
                    new_size(st.nbytes())
                    new_use(storage_uses(ptr) - 1)
                note_impl(impls, data, sid, getrefcount(data) - _FAST_REFS)  # NOTE [holder counts]
                size = sizes[sid]
                shape = data.shape
                dt = data.dtype
                dev = data.device
                e = {"slot": s, "shape": list(shape), "dtype": dtypes_get(dt) or dtype_str(dt),
                     "device": devices_get(dev) or device_str(dev), "nbytes": size, "status": "live",
                     "storage": sid}
                if not shape and dt in _SCALAR_DTYPES and dev.type == "cpu" and not data.requires_grad:
                    e["scalar"] = True  # a wrapped Python number: not an activation (saved._is_wrapped_scalar)
                else:
                    held_add(sid)
                    if node_sids is None:
                        node_sids = [sid]
                        held = size
                    elif sid not in node_sids:
                        node_sids.append(sid)
                        held += size
                saved.append(e)
            if fast:
                values = {}
                for s, attr in spec[3]:
                    try:
                        v = getattr(node, attr)
                    except RuntimeError:
                        values[s] = None
                        continue
                    tv = type(v)
                    if tv is int:
                        if v >= _I64_MAX:
                            v -= _U64
                    elif tv is tuple:
                        try:  # sizes, strides, dims: max() raises on None/mixed/empty
                            v = list(v) if max(v) < _I64_MAX else plain_value(v)
                        except (TypeError, ValueError):
                            v = plain_value(v)
                    elif not (tv is bool or tv is float or v is None or tv is str):
                        v = plain_value(v)
                    values[s] = v
        if not fast:
            info = spec[4]
            saved, values = read_saved(node, info, storages)
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
            special.append(nid)
        try:
            meta = node._input_metadata
        except (AttributeError, RuntimeError):
            meta = ()
        if len(meta) == 1:
            m = meta[0]
            dev = m.device
            device = devices_get(dev) or device_str(dev)
            out_shapes = [list(m.shape)]
            dt = m.dtype
            out_dtypes = [dtypes_get(dt) or dtype_str(dt)]
        elif meta:
            dev = meta[0].device
            device = devices_get(dev) or device_str(dev)
            out_shapes = [list(m.shape) for m in meta]
            out_dtypes = [dtypes_get(m.dtype) or dtype_str(m.dtype) for m in meta]
        else:
            device, out_shapes, out_dtypes = None, [], []
        if code == _OP:
            attrs[nid] = {"kind": "op", "name": spec[1], "saved": saved, "saved_bytes": held, "device": device,
                          "module": None, "root": False, "opaque": False, "seq": node._sequence_nr(),
                          "attrs": values, "out_shapes": out_shapes, "out_dtypes": out_dtypes}
        else:
            a = attrs[nid] = spec[4].template.copy()
            a["saved"] = saved
            a["saved_bytes"] = held
            a["device"] = device
            a["seq"] = node._sequence_nr()
            a["attrs"] = values
            a["out_shapes"] = out_shapes
            a["out_dtypes"] = out_dtypes
    succ, pred = _edges(ids, visited)
    index = {"special": special, "param_nodes": param_nodes,
             "held": held_extra + sum(sizes[s] for s in held_sids)}
    return ids, attrs, succ, pred, index


def _edges(ids: dict, visited: list):
    """Adjacency dicts; edge insertion order: consumers last-discovered first, inputs by index."""
    succ = {nid: {} for nid, _ in visited}
    pred = {nid: {} for nid, _ in visited}
    for nid, nexts in reversed(visited):
        into = pred[nid]
        index = 0
        for child, out_nr in nexts:
            u = ids[child]
            if u is not None:
                if u not in into:
                    succ[u][nid] = into[u] = {"index": index, "output": out_nr, "count": 1}
                else:
                    e = into[u]
                    e["count"] += 1
                    if out_nr != e["output"] or "outputs" in e:   # several outputs of u: the replay needs each
                        e.setdefault("outputs", [e["output"]] * (e["count"] - 1)).append(out_nr)
            index += 1
    return succ, pred
