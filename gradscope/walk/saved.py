"""Reading a node's saved values as metadata, never as live tensors: the general reader of the walk.

What a node class has (:class:`NodeType`, once per class) and every slot of a node read through the slot
classifier of ``slots.py`` (NOTE [saved slot states]), custom Functions and checkpoint inputs included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradscope.walk.copyslices import NAME as COPY_SLICES
from gradscope.walk.copyslices import read_copyslices
from gradscope.walk.slots import FREED_MARK, VERSION_RE, VIEW_MARK, SavedTensor, StorageIds, blank, classify
from gradscope.walk.values import dtype_str, plain_value

__all__ = ["NodeType", "node_type", "read_saved", "plain_value", "dtype_str"]


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
    compiled: bool  # a torch.compile region (AOTAutograd's CompiledFunction): walk/compiled.py
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
    compiled = fwd is not None and fwd.__name__ == "CompiledFunction"
    return NodeType(
        name, tensor_slots, value_slots, custom, function, opaque, name == "AccumulateGrad", compiled, template
    )


def read_saved(node, info: NodeType, storages: StorageIds) -> tuple[list[dict], dict]:
    """Read every saved slot of ``node`` as metadata.

    Returns:
        ``(saved, attrs)``: one dict per tensor slot (see NOTE [saved slot states]) and the non-tensor saved
        values as plain Python values (ints normalised to signed, dtypes as strings).
    """
    saved: list[dict] = []
    attrs: dict = {}
    if info.custom:
        _read_custom(node, saved, attrs, storages, info.compiled)
        return saved, attrs
    if info.name == COPY_SLICES:  # NOTE [CopySlices formula]
        return read_copyslices(node, storages)
    # The common case (a live, never-written slot) is read inline by fast.py; this is the general path.
    for s, raw_attr, attr in info.tensor_slots:
        try:
            raw = getattr(node, raw_attr)
        except RuntimeError as exc:  # a list of tensors (an index op's indices) freed by a backward
            saved.append(blank(s, "freed" if FREED_MARK in str(exc) else "opaque"))
            continue
        if type(raw) is not SavedTensor:
            for i, r in enumerate(raw):
                e = classify(node, f"{s}[{i}]", attr, r, storages)
                if e is not None:
                    saved.append(e)
            continue
        e = classify(node, s, attr, raw, storages)
        if e is not None:
            saved.append(e)
    if saved and any(e["status"] == "recomputed" for e in saved):  # NOTE [checkpoint inputs]
        from gradscope.walk.checkpoint import checkpoint_inputs, raw_slots

        saved.extend(checkpoint_inputs(raw_slots(node, info), storages, classify))
    for s, attr in info.value_slots:
        try:
            attrs[s] = plain_value(getattr(node, attr))
        except RuntimeError:
            attrs[s] = None
    return saved, attrs


def _read_custom(node, saved: list, attrs: dict, storages: StorageIds, compiled: bool = False) -> None:
    try:
        raws = node._raw_saved_tensors or ()
    except RuntimeError as exc:
        # Freed by a backward: torch no longer says how many tensors there were, and it raises the same
        # for a Function that saved none. A backward that reads ctx.saved_tensors will raise.
        if FREED_MARK in str(exc) and _reads_saved(node):
            saved.append(blank("saved_tensors", "freed"))
        raws = ()
    written = False
    sids: list = []
    for i, raw in enumerate(raws):
        slot = f"saved_tensors[{i}]"
        if raw.unpack_hook is None and raw.data is None:
            e = _freed_or_none(node, slot)
        else:
            e = classify(node, slot, None, raw, storages)
            written = written or (e["status"] == "live" and raw.data._version > 0)
        if e is not None:
            saved.append(e)
        sids.append(e.get("storage") if e is not None else None)
    if compiled:  # NOTE [compiled region memory]
        from gradscope.walk.compiled import region_attrs
        from gradscope.walk.regionmem import region_steps

        attrs.update(region_steps(node, sids))
        attrs.update(region_attrs(node))  # what the picture draws: NOTE [compiled region sources]
    if written:
        _check_custom_versions(node, saved)
    if any(e["status"] == "recomputed" for e in saved):  # NOTE [checkpoint inputs]
        from gradscope.walk.checkpoint import checkpoint_inputs

        saved.extend(checkpoint_inputs(raws, storages, classify))
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
        return blank(slot, "freed" if FREED_MARK in str(exc) else "opaque")
    return None


def _check_custom_versions(node, saved: list) -> None:
    # A custom Function exposes only saved_tensors (all slots at once), so the error names no slot: mark
    # the first live slot whose current version matches the one in the message.
    try:
        _ = node.saved_tensors
    except RuntimeError as exc:
        m = VERSION_RE.search(str(exc))
        if not m and VIEW_MARK in str(exc):  # a saved split/unbind view whose base was written
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
