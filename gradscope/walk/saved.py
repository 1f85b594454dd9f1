"""Reading a node's saved values as metadata, never as live tensors.

See NOTE [saved slot states] for how each slot is classified without raising, without calling an unpack
hook that has side effects, and without bumping any version counter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import overload

import torch

from gradscope.walk.values import dtype_str, plain_value

__all__ = ["HELD", "NodeType", "node_type", "read_saved", "StorageIds", "plain_value", "dtype_str", "device_str"]

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

_VERSION_RE = re.compile(r"is at version (\d+); expected version (\d+)")
# Both torch messages for a multi-output view (split/unbind) whose base was written in place: "Output 1 of
# Split is a view and its base ..." and "A view was created in no_grad mode and its base ..." (issue 16).
_VIEW_MARK = "its base or another view of its base has been modified inplace"
_FREED_MARK = "backward through the graph a second time"

_OPAQUE_FUNCTIONS = ("CheckpointFunction", "CompiledFunction")


@dataclass(frozen=True, slots=True)
class NodeType:
    """What we know about a node class, computed once per class (dir() is slow)."""

    name: str
    tensor_slots: tuple[tuple[str, str, str], ...]  # (slot, "_raw_saved_<slot>", "_saved_<slot>")
    value_slots: tuple[tuple[str, str], ...]  # (slot, "_saved_<slot>")
    custom: bool
    function: str | None
    opaque: bool
    leaf: bool
    template: dict  # the constant part of an op node's attributes, copied per node


_TYPE_CACHE: dict[type, NodeType] = {}


def node_type(node) -> NodeType:
    """Return the cached :class:`NodeType` of ``node``'s class."""
    cls = type(node)
    info = _TYPE_CACHE.get(cls)
    if info is None:
        info = _TYPE_CACHE[cls] = _make_type(node, cls)
    return info


def _make_type(node, cls) -> NodeType:
    names = dir(cls)
    raw = {n[len("_raw_saved_") :] for n in names if n.startswith("_raw_saved_")}
    saved = [n[len("_saved_") :] for n in names if n.startswith("_saved_")]
    tensor_slots = tuple((s, "_raw_saved_" + s, "_saved_" + s) for s in saved if s in raw)
    value_slots = tuple((s, "_saved_" + s) for s in saved if s not in raw)
    fwd = getattr(node, "_forward_cls", None)
    custom = fwd is not None
    function = None
    opaque = False
    if fwd is not None:  # custom
        function = f"{fwd.__module__}.{fwd.__qualname__}"
        opaque = fwd.__name__ in _OPAQUE_FUNCTIONS
        name = f"{fwd.__name__}Backward"
    else:
        name = cls.__name__
    template = {
        "kind": "op",
        "name": name,
        "saved": None,
        "saved_bytes": 0,
        "device": None,
        "module": None,
        "root": False,
        "opaque": opaque,
        "seq": None,
        "attrs": None,
        "out_shapes": None,
    }
    if function is not None:
        template["function"] = function
    return NodeType(name, tensor_slots, value_slots, custom, function, opaque, name == "AccumulateGrad", template)


class StorageIds:
    """Maps storages to small deterministic ids (discovery order) and remembers their sizes.

    The key is the StorageImpl pointer (``untyped_storage()._cdata``), which tells storages apart on every
    device, ``meta`` included, where ``data_ptr()`` is 0 for every tensor.
    """

    __slots__ = ("ids", "sizes", "frames", "uses", "impls", "regions")

    def __init__(self) -> None:
        self.ids: dict[int, int] = {}
        self.sizes: list[int] = []
        self.frames: set[int] = set()  # checkpoint frames already listed this walk (_checkpoint.py)
        self.uses: list[int] = []  # storage use count at first sight: NOTE [holder counts], walk/holders.py
        self.impls: dict[int, list] = {}
        self.regions: dict[int, tuple] = {}  # id(checkpoint frame) -> (region number, {id(holder): i})

    def key(self, t: torch.Tensor) -> tuple[int | None, int]:
        """Return ``(storage_id, storage_nbytes)`` of a tensor; id None when it has no plain storage."""
        try:
            st = t.untyped_storage()
            ptr, size = st._cdata, st.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):
            return None, _dense_nbytes(t)
        sid = self.ids.get(ptr)
        if sid is None:
            sid = self.ids[ptr] = len(self.sizes)
            self.sizes.append(size)
            self.uses.append(_storage_uses(ptr) - 1)  # - 1: our `st`
        note_impl(self.impls, t, sid, getrefcount(t) - _KEY_REFS)
        return sid, size


from gradscope.walk.holders import _KEY_REFS, getrefcount, note_impl  # noqa: E402
from gradscope.walk.holders import storage_uses as _storage_uses  # noqa: E402


def _dense_nbytes(t: torch.Tensor) -> int:
    try:
        if t.is_sparse:
            return _dense_nbytes(t._values()) + _dense_nbytes(t._indices())
        return t.numel() * t.element_size()
    except Exception:  # noqa: BLE001 - exotic tensor subclasses: size unknown
        return 0


def _is_wrapped_scalar(t: torch.Tensor) -> bool:
    # Python numbers in ops such as x * 2 or x / 4.0 are saved as 0-d int64/float64 CPU tensors that never
    # pass through pack hooks and are not activations (TORCH-FACTS section 10).
    return (
        t.dim() == 0
        and t.dtype in (torch.float64, torch.int64, torch.complex128, torch.bool)
        and t.device.type == "cpu"
        and not t.requires_grad
    )


_DEVICES: dict = {}
# Private torch APIs read here (to move into gradscope/_torch.py): the SavedTensor type and its
# ``data`` / ``unpack_hook``; on nodes ``_raw_saved_*`` / ``_saved_*`` (found by dir()),
# ``_raw_saved_tensors`` / ``saved_tensors`` / ``_forward_cls`` of custom Functions; ``_cdata`` of storages.
_SavedTensor = torch._C._autograd.SavedTensor


def device_str(device) -> str:
    """``device(type='cpu') -> 'cpu'`` (cached: str(device) is slow)."""
    text = _DEVICES.get(device)
    if text is None:
        text = _DEVICES[device] = str(device)
    return text


def _meta(slot: str, t: torch.Tensor, status: str, storages: StorageIds, device=None) -> dict:
    sid, size = storages.key(t)
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
    if shape is not None and not shape and _is_wrapped_scalar(t):
        entry["scalar"] = True
    return entry


def _blank(slot: str, status: str) -> dict:
    return {"slot": slot, "shape": None, "dtype": None, "device": None, "nbytes": 0, "status": status, "storage": None}


@overload
def _classify(node, slot: str, attr: None, raw, storages: StorageIds) -> dict: ...
@overload
def _classify(node, slot: str, attr: str, raw, storages: StorageIds) -> dict | None: ...
def _classify(node, slot: str, attr: str | None, raw, storages: StorageIds) -> dict | None:
    """Classify one SavedTensor (see NOTE [saved slot states]).

    ``attr`` is None for a custom Function's slot, which callers only pass with a hook or ``raw.data`` set:
    such a slot never reaches the never-saved case (the only ``None`` result).
    """
    data = raw.data
    if raw.unpack_hook is not None:
        if isinstance(data, torch.Tensor):
            return _meta(slot, data, "hooked", storages)
        if isinstance(data, tuple) and len(data) == 2 and isinstance(data[1], torch.Tensor):
            return _meta(slot, data[1], "offloaded", storages, device=data[0])
        if type(data).__name__ == "_Holder":
            from gradscope.walk.checkpoint import holder_meta

            entry = _blank(slot, "recomputed")
            meta = holder_meta(raw.unpack_hook, data, storages)
            if meta:
                entry["recompute"] = meta  # what backward's recompute re-creates (walk/checkpoint.py)
            return entry
        return _blank(slot, "opaque")
    if data is None:
        assert attr is not None  # attr None (a custom Function's slot) comes with data set (see above)
        try:
            value = getattr(node, attr)
        except RuntimeError as exc:
            return _blank(slot, "freed" if _FREED_MARK in str(exc) else "opaque")
        return None if value is None else _blank(slot, "opaque")
    entry = _meta(slot, data, "live", storages)
    if attr is None:  # custom Function: versions are checked for all slots at once
        entry["_version"] = data._version
        return entry
    if data._version > 0:
        try:
            getattr(node, attr)
        except RuntimeError as exc:
            m = _VERSION_RE.search(str(exc))
            if m:
                entry["status"] = "stale"
                entry["version"] = int(m.group(1))
                entry["saved_version"] = int(m.group(2))
            elif _VIEW_MARK in str(exc):
                # A saved output view of a multi-output op (split, chunk, unbind) whose base was modified
                # in place: torch refuses it with its own message, which names no saved version.
                entry["status"] = "stale"
                entry["version"] = data._version
                entry["saved_version"] = None
    return entry


def read_saved(node, info: NodeType, storages: StorageIds) -> tuple[list[dict], dict]:
    """Read every saved slot of ``node`` as metadata.

    Returns:
        ``(saved, attrs)``: one dict per tensor slot (see NOTE [saved slot states]) and the non-tensor saved
        values as plain Python values (ints normalised to signed, dtypes as strings).
    """
    saved: list[dict] = []
    attrs: dict = {}
    if info.custom:
        _read_custom(node, saved, attrs, storages)
        return saved, attrs
    # The common case (a live, never-written slot) is read inline by _walk.py; this is the general path.
    for s, raw_attr, attr in info.tensor_slots:
        try:
            raw = getattr(node, raw_attr)
        except RuntimeError as exc:  # a list of tensors (an index op's indices) freed by a backward
            saved.append(_blank(s, "freed" if _FREED_MARK in str(exc) else "opaque"))
            continue
        if type(raw) is not _SavedTensor:
            for i, r in enumerate(raw):
                e = _classify(node, f"{s}[{i}]", attr, r, storages)
                if e is not None:
                    saved.append(e)
            continue
        e = _classify(node, s, attr, raw, storages)
        if e is not None:
            saved.append(e)
    if saved and any(e["status"] == "recomputed" for e in saved):  # NOTE [checkpoint inputs]
        from gradscope.walk.checkpoint import checkpoint_inputs, raw_slots

        saved.extend(checkpoint_inputs(raw_slots(node, info), storages, _classify))
    for s, attr in info.value_slots:
        try:
            attrs[s] = plain_value(getattr(node, attr))
        except RuntimeError:
            attrs[s] = None
    return saved, attrs


def _read_custom(node, saved: list, attrs: dict, storages: StorageIds) -> None:
    try:
        raws = node._raw_saved_tensors or ()
    except RuntimeError as exc:
        # Freed by a backward: torch no longer says how many tensors there were, and it raises the same
        # for a Function that saved none. A backward that reads ctx.saved_tensors will raise.
        if _FREED_MARK in str(exc) and _reads_saved(node):
            saved.append(_blank("saved_tensors", "freed"))
        raws = ()
    written = False
    for i, raw in enumerate(raws):
        slot = f"saved_tensors[{i}]"
        if raw.unpack_hook is None and raw.data is None:
            e = _freed_or_none(node, slot)
        else:
            e = _classify(node, slot, None, raw, storages)
            written = written or (e["status"] == "live" and raw.data._version > 0)
        if e is not None:
            saved.append(e)
    if written:
        _check_custom_versions(node, saved)
    if any(e["status"] == "recomputed" for e in saved):  # NOTE [checkpoint inputs]
        from gradscope.walk.checkpoint import checkpoint_inputs

        saved.extend(checkpoint_inputs(raws, storages, _classify))
    for e in saved:
        e.pop("_version", None)
    for key, value in getattr(node, "__dict__", {}).items():
        if not key.startswith("_") and isinstance(value, (int, float, str, bool, tuple, type(None))):
            attrs[key] = plain_value(value)
    fn = getattr(node, "run_function", None)  # a reentrant checkpoint: its module's parameters get grads
    module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if isinstance(module, torch.nn.Module):
        attrs["region_params"] = [
            [list(p.shape), dtype_str(p.dtype), p.grad is not None, id(p)]
            for p in module.parameters()
            if p.requires_grad
        ]
    if fn is not None:
        from gradscope.walk.checkpoint import reentrant_recompute

        mod = module if isinstance(module, torch.nn.Module) else None
        attrs["region_recompute"] = reentrant_recompute(node, mod)  # NOTE [reentrant layers]


_READS_SAVED: dict = {}


def _reads_saved(node) -> bool:
    """Whether the custom Function's ``backward`` can read its saved tensors (True when unsure)."""
    fwd = getattr(node, "_forward_cls", None)
    known = _READS_SAVED.get(fwd)
    if known is None:
        code = getattr(getattr(fwd, "backward", None), "__code__", None)
        known = _READS_SAVED[fwd] = (
            code is None
            or bool({"saved_tensors", "saved_variables", "_raw_saved_tensors"} & set(code.co_names))
            or bool(code.co_freevars)
        )
    return known


def _freed_or_none(node, slot: str) -> dict | None:
    try:
        _ = node.saved_tensors
    except RuntimeError as exc:
        return _blank(slot, "freed" if _FREED_MARK in str(exc) else "opaque")
    return None


def _check_custom_versions(node, saved: list) -> None:
    # A custom Function exposes only saved_tensors (all slots at once), so the error names no slot: mark
    # the first live slot whose current version matches the one in the message.
    try:
        _ = node.saved_tensors
    except RuntimeError as exc:
        m = _VERSION_RE.search(str(exc))
        if not m and _VIEW_MARK in str(exc):  # a saved split/unbind view whose base was written (issue 16)
            for e in saved:
                if e["status"] == "live" and e.get("_version", 0) > 0:
                    e.update(status="stale", version=e["_version"], saved_version=None)
                    break
        if m:
            for e in saved:
                if e["status"] == "live" and e.get("_version") == int(m.group(1)):
                    e["status"] = "stale"
                    e["version"] = int(m.group(1))
                    e["saved_version"] = int(m.group(2))
                    break
