"""The slot classifier: one saved tensor slot read as metadata, in exactly one state, never as a live tensor.

See NOTE [saved slot states] for how each slot is classified without raising, without calling an unpack
hook that has side effects, and without bumping any version counter. :class:`StorageIds` gives storages
their small ids and counts their holders (NOTE [holder counts]).
"""

from __future__ import annotations

import re
from typing import overload

import torch

from gradscope.walk.holders import _KEY_REFS, getrefcount, note_impl
from gradscope.walk.holders import storage_uses as _storage_uses
from gradscope.walk.values import dtype_str

__all__ = [
    "HELD",
    "StorageIds",
    "classify",
    "blank",
    "slot_meta",
    "device_str",
    "DEVICES",
    "SavedTensor",
    "FREED_MARK",
    "VERSION_RE",
    "VIEW_MARK",
    "is_wrapped_scalar",
]

# NOTE [saved slot states]
# Every tensor slot of a node ends up in exactly one state:
#   live       raw.data is a Tensor and no unpack hook: the storage is held by the graph.
#   stale      live, but the tensor was modified in place after it was saved: backward() will raise.
#              The saved version is not exposed by torch; it only appears in the error that reading the
#              slot raises. Versions only grow, so a slot whose current version is 0 cannot be stale and
#              we only pay for the getattr (and its exception) when the current version is above 0.
#   hooked     saved under saved_tensors_hooks that packed the tensor itself: metadata read from the packed
#              tensor; the unpack hook is never called (it may have side effects).
#   offloaded  torch.autograd.graph.save_on_cpu: raw.data is (device, cpu_tensor); bytes live on the CPU.
#   recomputed checkpoint(use_reentrant=False): raw.data is a _Holder; reading the slot would re-run the
#              forward, so we never do. Holds no bytes.
#   opaque     another pack hook whose packed value we cannot read.
#   freed      a backward without retain_graph released it (raw.data is None and reading raises).
# A slot that was never saved (raw.data is None, getattr returns None) is left out.

#: Slot states whose bytes the graph holds on the tensor's device (see NOTE [saved slot states]).
HELD = ("live", "stale", "hooked")

VERSION_RE = re.compile(r"is at version (\d+); expected version (\d+)")
# Both torch messages for a multi-output view (split/unbind) whose base was written in place: "Output 1 of
# Split is a view and its base ..." and "A view was created in no_grad mode and its base ...".
VIEW_MARK = "its base or another view of its base has been modified inplace"
FREED_MARK = "backward through the graph a second time"


class StorageIds:
    """Maps storages to small deterministic ids (discovery order) and remembers their sizes.

    The key is the StorageImpl pointer (``untyped_storage()._cdata``), which tells storages apart on every
    device, ``meta`` included, where ``data_ptr()`` is 0 for every tensor.
    """

    __slots__ = ("ids", "sizes", "frames", "uses", "impls", "regions")

    def __init__(self) -> None:
        self.ids: dict[int, int] = {}
        self.sizes: list[int] = []
        self.frames: set[int] = set()  # checkpoint frames already listed this walk (checkpoint.py)
        self.uses: list[int] = []  # storage use count at first sight: NOTE [holder counts], walk/holders.py
        self.impls: dict[int, list] = {}
        self.regions: dict[int, tuple] = {}  # id(checkpoint frame) -> (region number, {id(holder): i})

    def key(self, t: torch.Tensor, refs: int = _KEY_REFS) -> tuple[int | None, int]:
        """Return ``(storage_id, storage_nbytes)`` of a tensor; id None when it has no plain storage.

        ``refs``: the Python references the caller's path holds on ``t`` (NOTE [holder counts])."""
        try:
            st = t.untyped_storage()
            ptr, size = st._cdata, st.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):
            return None, dense_nbytes(t)
        sid = self.ids.get(ptr)
        if sid is None:
            sid = self.ids[ptr] = len(self.sizes)
            self.sizes.append(size)
            self.uses.append(_storage_uses(ptr) - 1)  # - 1: our `st`
        note_impl(self.impls, t, sid, getrefcount(t) - refs)
        return sid, size


def dense_nbytes(t: torch.Tensor) -> int:
    try:
        if t.is_sparse:
            return dense_nbytes(t._values()) + dense_nbytes(t._indices())
        return t.numel() * t.element_size()
    except Exception:  # noqa: BLE001 - exotic tensor subclasses: size unknown
        return 0


def is_wrapped_scalar(t: torch.Tensor) -> bool:
    # Python numbers in ops such as x * 2 or x / 4.0 are saved as 0-d int64/float64 CPU tensors that never
    # pass through pack hooks and are not activations (docs/internals.md#wrapped-python-scalars).
    return (
        t.dim() == 0
        and t.dtype in (torch.float64, torch.int64, torch.complex128, torch.bool)
        and t.device.type == "cpu"
        and not t.requires_grad
    )


DEVICES: dict = {}
# Private torch APIs read here (to move into gradscope/_torch.py): the SavedTensor type and its
# ``data`` / ``unpack_hook``; on nodes ``_raw_saved_*`` / ``_saved_*`` (found by dir()),
# ``_raw_saved_tensors`` / ``saved_tensors`` / ``_forward_cls`` of custom Functions; ``_cdata`` of storages.
SavedTensor = torch._C._autograd.SavedTensor


def device_str(device) -> str:
    """``device(type='cpu') -> 'cpu'`` (cached: str(device) is slow)."""
    text = DEVICES.get(device)
    if text is None:
        text = DEVICES[device] = str(device)
    return text


def slot_meta(
    slot: str, t: torch.Tensor, status: str, storages: StorageIds, device=None, refs: int = _KEY_REFS
) -> dict:
    sid, size = storages.key(t, refs)
    try:
        shape = t.shape
    except RuntimeError:  # a nested tensor: torch gives no shape (dtype, device and storage it does give)
        shape = None
    entry = {
        "slot": slot,
        "shape": None if shape is None else list(shape),
        "dtype": dtype_str(t.dtype),
        "device": device_str(t.device if device is None else device),
        "nbytes": size,
        "status": status,
        "storage": sid,
    }
    if shape is not None and not shape and is_wrapped_scalar(t):
        entry["scalar"] = True
    try:
        if not t.is_contiguous():
            entry["stride"] = list(t.stride())
    except RuntimeError:  # a nested or sparse tensor: no strides
        pass
    return entry


def blank(slot: str, status: str) -> dict:
    return {"slot": slot, "shape": None, "dtype": None, "device": None, "nbytes": 0, "status": status, "storage": None}


@overload
def classify(node, slot: str, attr: None, raw, storages: StorageIds) -> dict: ...
@overload
def classify(node, slot: str, attr: str, raw, storages: StorageIds) -> dict | None: ...
def classify(node, slot: str, attr: str | None, raw, storages: StorageIds) -> dict | None:
    """Classify one SavedTensor (see NOTE [saved slot states]).

    ``attr`` is None for a custom Function's slot, which callers only pass with a hook or ``raw.data`` set:
    such a slot never reaches the never-saved case (the only ``None`` result).
    """
    data = raw.data
    if raw.unpack_hook is not None:
        if isinstance(data, torch.Tensor):
            return slot_meta(slot, data, "hooked", storages)
        if isinstance(data, tuple) and len(data) == 2 and isinstance(data[1], torch.Tensor):
            return slot_meta(slot, data[1], "offloaded", storages, device=data[0])
        if type(data).__name__ == "_Holder":
            from gradscope.walk.checkpoint import holder_meta

            entry = blank(slot, "recomputed")
            meta = holder_meta(raw.unpack_hook, data, storages)
            if meta:
                entry["recompute"] = meta  # what backward's recompute re-creates (walk/checkpoint.py)
            return entry
        return blank(slot, "opaque")
    if data is None:
        assert attr is not None  # attr None (a custom Function's slot) comes with data set (see above)
        try:
            value = getattr(node, attr)
        except RuntimeError as exc:
            return blank(slot, "freed" if FREED_MARK in str(exc) else "opaque")
        return None if value is None else blank(slot, "opaque")
    entry = slot_meta(slot, data, "live", storages)
    if attr is None:  # custom Function: versions are checked for all slots at once
        entry["_version"] = data._version
        return entry
    if data._version > 0:
        try:
            getattr(node, attr)
        except RuntimeError as exc:
            m = VERSION_RE.search(str(exc))
            if m:
                entry["status"] = "stale"
                entry["version"] = int(m.group(1))
                entry["saved_version"] = int(m.group(2))
            elif VIEW_MARK in str(exc):
                # A saved output view of a multi-output op (split, chunk, unbind) whose base was modified
                # in place: torch refuses it with its own message, which names no saved version.
                entry["status"] = "stale"
                entry["version"] = data._version
                entry["saved_version"] = None
    return entry
