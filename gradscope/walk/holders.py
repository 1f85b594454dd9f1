"""Who else holds a saved storage: the holder counts behind backward's frees.

NOTE [holder counts]
``backward()`` frees a saved tensor's storage only when its last holder goes: another node's saved slot,
a view, a Python variable the user still holds (the input batch, an output kept for logging), a
parameter, an AccumulateGrad's leaf. The graph shows the saved slots; the rest is detected, not assumed,
while the walk holds the slot's tensor (docs/internals.md#what-one-node-does-to-memory):

- ``torch._C._storage_Use_Count(ptr)``: the storage's references, one per TensorImpl using it (plus our
  own ``UntypedStorage`` handle, subtracted). More TensorImpls than the saved slots show means another
  tensor (a view, the forward output the user kept while the node saved a copy of it) keeps it.
- ``t._use_count()``: the TensorImpl's references: our Python wrapper, one per SavedVariable that holds
  this very TensorImpl (saved inputs), and anything else in C++ (an AccumulateGrad's variable).
- ``sys.getrefcount(t)``: Python references to the wrapper beyond the walk's own (a user variable, a
  list, a ``ctx`` attribute, a module attribute). Each call site passes the count minus its own
  references (``_FAST_REFS`` / ``_KEY_REFS``, checked by tests/memory/test_backward_memory.py: one off either
  way fails it). The walk's fast path (``loop.py``) does what :func:`note_impl` does inline, in the same
  order of reads; :func:`note_base` is the shared part for a view's base.

:func:`external` turns the counts into the storages that backward cannot free. Only ids and counts are
kept: no tensor outlives the walk.
"""

from __future__ import annotations

import sys

from gradscope._torchcheck import read

__all__ = ["note_impl", "note_base", "external", "storage_uses", "getrefcount"]

storage_uses = read("_C._storage_Use_Count", "storage-identity")
getrefcount = sys.getrefcount

#: Python references the walk's fast path holds on a slot's tensor when it counts them inline (measured: its
#: local, getrefcount's argument, the reference the TensorImpl keeps on its preserved wrapper).
_FAST_REFS = 3
#: The same inside ``StorageIds.key`` (called from ``_meta`` from ``_classify``: two more frames).
_KEY_REFS = 6
#: The same for a view's ``_base`` read inside :func:`note_impl`.
_BASE_REFS = 3


def note_impl(impls: dict, t, sid: int, py_extra: int) -> None:
    """Record one saved slot holding tensor ``t`` (storage ``sid``); ``py_extra``: Python refs not ours.

    A view made while grad mode was on holds its base: the base is recorded too (``views`` counts the
    slots' views that hold it), so a base that only the graph's views keep is not taken for a user's.
    """
    try:
        key = t._cdata
        uses = t._use_count() - 1  # - 1: our wrapper
        view = t._is_view()
    except (AttributeError, RuntimeError):
        return
    rec = impls.get(key)
    if rec is None:
        rec = impls[key] = [sid, uses, py_extra, 0, 0]
    rec[3] += 1
    if py_extra > rec[2]:
        rec[2] = py_extra
    if view and rec[3] == 1:
        note_base(impls, t, sid)


def note_base(impls: dict, t, sid: int) -> None:
    """Record the base of the view ``t``, seen in a saved slot for the first time (``views`` counts them)."""
    try:
        base = t._base
        if base is None:
            return
        bkey = base._cdata
    except (AttributeError, RuntimeError):
        return
    brec = impls.get(bkey)
    if brec is None:
        brec = impls[bkey] = [sid, base._use_count() - 1, getrefcount(base) - _BASE_REFS, 0, 0]
    brec[4] += 1


def external(uses: list, impls: dict) -> list[int]:
    """Storage ids that a holder outside the graph keeps alive (see NOTE [holder counts])."""
    per_storage = [0] * len(uses)  # TensorImpls seen per storage id (every id has its use count)
    out = set()
    for sid, tensor_uses, py_extra, slots, views in impls.values():
        per_storage[sid] += 1
        if py_extra > 0 or tensor_uses > slots + views:
            out.add(sid)
    out.update(sid for sid, (u, n) in enumerate(zip(uses, per_storage)) if n and u > n)
    return sorted(out)
