"""The fast path of the walk: one op node whose saved slots are all plain live tensors, read inline.

NOTE [walk fast path] (``loop.py``) says when it applies. :func:`fast_reader` binds the walk's tables once
(closure cells read almost as fast as locals) and returns the reader the loop calls per op node: it gives
the node's flat slot record, its held bytes and its outputs when a slot gives them, or, when a slot leaves
the fast path, the number of slots it already counted, so the general reader can take over
(:func:`uncount` undoes their holder counts).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gradscope._torch import SAVED_TENSOR
from gradscope.walk.holders import _FAST_REFS, getrefcount, note_base, storage_uses
from gradscope.walk.slots import DEVICES as _DEVICES
from gradscope.walk.slots import StorageIds, device_str
from gradscope.walk.spec import ClassSpec
from gradscope.walk.values import DTYPES as _DTYPES
from gradscope.walk.values import dtype_str

__all__ = ["fast_reader", "uncount"]

# Private torch API (to move into gradscope/_torch.py with the rest of the walk's): the SavedTensor type,
# ``_raw_saved_*`` / ``_saved_*`` on nodes, ``_version`` / ``_cdata`` / ``_use_count()`` / ``_is_view()`` on
# tensors and ``_cdata`` (the StorageImpl pointer) on storages.
_SavedTensor = SAVED_TENSOR
_SCALAR_DTYPES = frozenset((torch.float64, torch.int64, torch.complex128, torch.bool))
_STORAGE_ERRORS = (RuntimeError, NotImplementedError, TypeError)

#: What the reader returns for a node it read: (flat slot record, held bytes, outputs or None).
Read = tuple[tuple, int, tuple | None]


def fast_reader(storages: StorageIds, shapes: dict, slot_outs: dict, held_add: Callable, strides: dict) -> Callable:
    """The per-node fast reader over the walk's tables (``shapes``/``slot_outs`` intern what it reads; ``held_add``
    collects held storage ids; ``strides``: node index -> {slot: strides} of non-contiguous saved tensors)."""
    sids = storages.ids
    sids_get = sids.get
    sizes = storages.sizes
    new_size = sizes.append
    new_use = storages.uses.append
    impls = storages.impls
    impls_get = impls.get
    shape_get = shapes.get
    slot_outs_get = slot_outs.get
    dtypes_get = _DTYPES.get
    devices_get = _DEVICES.get

    def read(node, spec: ClassSpec, i: int) -> Read | int:
        rec: tuple = ()  # () + t is t itself: no copy for the common single slot
        node_sids = None
        held = 0
        out = None  # the outputs, when a saved slot gives them: NOTE [outputs from a saved slot]
        out_slot = spec.out_slot
        for s, raw_attr, attr in spec.tensor_slots:
            try:
                raw = getattr(node, raw_attr)
            except RuntimeError:
                return len(rec) // 5
            # the SavedTensor stub lacks the real ``unpack_hook`` and ``data`` properties
            if type(raw) is not _SavedTensor or raw.unpack_hook is not None:  # type: ignore[attr-defined]
                return len(rec) // 5
            data = raw.data  # type: ignore[attr-defined]  # stub lacks it (see above)
            if data is None:
                try:  # never saved (an optional input, or one that needs no gradient) unless it raises
                    if getattr(node, attr) is None:
                        continue
                except RuntimeError:
                    pass
                return len(rec) // 5
            version = data._version
            if version:
                try:  # written in place at some point: stale only if reading the slot raises
                    getattr(node, attr)
                except RuntimeError:
                    return len(rec) // 5
            try:
                st = data.untyped_storage()
                ptr = st._cdata
                shape = data.shape
                key = data._cdata
            except _STORAGE_ERRORS:  # no plain storage, or a nested tensor: the general reader
                return len(rec) // 5
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
            if not data.is_contiguous():
                strides.setdefault(i, {})[s] = list(data.stride())
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
                # a wrapped Python number: not an activation (slots.is_wrapped_scalar); ~sid marks it
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
        return rec, held, out

    return read


def uncount(node, slots, n: int, impls: dict) -> None:
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
