"""What a non-reentrant ``checkpoint`` region keeps alive: the inputs it saved to recompute from.

NOTE [checkpoint inputs]
Under ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)`` every tensor the region saves
becomes a ``_Holder`` (status ``recomputed``, no bytes), but the region itself saves ``args`` so that
backward can re-run ``fn``: ``_CheckpointFrame.save_inputs`` wraps each tensor argument in a
``SavedTensor`` (through any outer ``saved_tensors_hooks``, e.g. ``save_on_cpu``). Those inputs are what a
checkpointed model holds per block, and they are reachable only from the slots' unpack hook (a closure
over the frame), not through ``next_functions``. We read them read-only: the frame is found among the
hook's closure cells, the inputs' ``SavedTensor.data`` gives their metadata, and nothing is unpacked or
recomputed. An input whose storage this walk already met is skipped, so each frame's inputs are listed
once, on the first node of the region the walk reaches (the region's last op, the walk being root-first).
If torch changes these internals, we find no frame and report nothing extra.
"""

from __future__ import annotations

import re

import torch

from gradscope._torch import SAVED_TENSOR
from gradscope.walk.values import dtype_str

__all__ = ["checkpoint_inputs", "raw_slots", "holder_meta", "region_layers", "reentrant_recompute"]

# Private torch APIs read here (to move into gradscope/_torch.py): torch.utils.checkpoint's
# ``_CheckpointFrame`` (found by class name) and its ``saved_args``, the ``_Holder`` class name, and
# ``SavedTensor.data`` / ``unpack_hook`` / ``unpack()``.
_MAX_DEPTH = 3
_VERSION_RE = re.compile(r"is at version (\d+); expected version (\d+)")


def _frame(unpack_hook):
    """The ``_CheckpointFrame`` an unpack hook closes over, or None (looks a few closures deep)."""
    todo = [(unpack_hook, 0)]
    while todo:
        fn, depth = todo.pop()
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # empty cell
                continue
            if type(value).__name__ == "_CheckpointFrame" and hasattr(value, "saved_args"):
                return value
            if callable(value) and depth + 1 < _MAX_DEPTH and getattr(value, "__closure__", None):
                todo.append((value, depth + 1))
    return None


def raw_slots(node, info) -> list:
    """The raw ``SavedTensor`` objects of a generated node (``info`` is its ``saved.NodeType``)."""
    out: list = []
    for slot in info.tensor_slots:
        raw_attr = slot[1] if isinstance(slot, tuple) else "_raw_saved_" + slot
        try:
            raw = getattr(node, raw_attr)
        except RuntimeError:
            continue
        out.extend(raw if isinstance(raw, (list, tuple)) else (raw,))
    return out


def checkpoint_inputs(raws, storages, classify) -> list[dict]:
    """Saved-slot entries for the inputs of the checkpoint frame behind ``raws``, not yet seen this walk.

    Args:
        raws: the node's raw ``SavedTensor`` objects (any order).
        storages: the walk's ``StorageIds``.
        classify: ``slots.classify`` (passed in to avoid an import cycle).

    Returns:
        One entry per new input storage, slot ``"checkpoint input[i]"``; ``[]`` when there is no frame.
    """
    frame = None
    for raw in raws:
        hook = getattr(raw, "unpack_hook", None)
        if hook is not None and type(getattr(raw, "data", None)).__name__ == "_Holder":
            frame = _frame(hook)
            if frame is not None:
                break
    if frame is None:
        return []
    frames = getattr(storages, "frames", None)
    if frames is not None:  # one listing per frame and walk, whichever node of the region we meet
        if id(frame) in frames:
            return []
        frames.add(id(frame))
    out = []
    saved_type = SAVED_TENSOR
    for i, arg in enumerate(getattr(frame, "saved_args", ())):
        if not isinstance(arg, saved_type):
            continue
        data = arg.data  # type: ignore[attr-defined]  # the SavedTensor stub lacks the real ``data``
        tensor = (
            data
            if isinstance(data, torch.Tensor)
            else (data[1] if isinstance(data, tuple) and len(data) == 2 and isinstance(data[1], torch.Tensor) else None)
        )
        if tensor is None:
            continue
        stale = _stale(arg, tensor)
        del data, tensor  # our references would read as a holder outside the graph (walk/holders.py)
        entry = classify(None, f"checkpoint input[{i}]", None, arg, storages)
        if entry is not None:
            entry.pop("_version", None)
            if stale is not None and entry["status"] == "live":
                entry["status"] = "stale"
                entry["version"], entry["saved_version"] = stale
            out.append(entry)
    return out


def _stale(arg, tensor):
    """``(version, saved_version)`` when a checkpoint input was modified in place after it was saved.

    The recomputation in backward unpacks it with a version check and raises 'modified by an inplace
    operation'. Unpacking a saved input without hooks only returns the tensor (no recomputation), and
    we only try when its version moved since creation; under pack hooks torch checks nothing.
    """
    if arg.unpack_hook is not None or tensor._version == 0:
        return None
    try:
        arg.unpack()
    except RuntimeError as exc:
        m = _VERSION_RE.search(str(exc))
        if m:
            return int(m.group(1)), int(m.group(2))
        if "its base or another view of its base has been modified inplace" in str(exc):
            return tensor._version, None  # a split/unbind view whose base was written
    return None


def holder_meta(unpack_hook, holder, storages) -> dict | None:
    """What backward's recompute will re-create for one checkpointed slot, from the frame's own records.

    The frame appends, per packed tensor, a weak reference to its ``_Holder`` and (with the default
    ``determinism_check``) ``{"shape", "dtype", "device"}`` to ``x_metadatas``, in the same order. Returns
    ``{"region": n, "index": i, "shape", "dtype", "nbytes"}`` (``n`` numbers the frames of this walk), or
    None when the frame or its metadata cannot be found. Nothing is unpacked.
    """
    frame = _frame(unpack_hook)
    if frame is None:
        return None
    regions = storages.regions
    rec = regions.get(id(frame))
    if rec is None:
        index = {}
        for i, ref in enumerate(getattr(frame, "weak_holders", ())):
            h = ref()
            if h is not None:
                index[id(h)] = i
        rec = regions[id(frame)] = (len(regions), index, frame, _frame_tensor_bytes(frame))
    i = rec[1].get(id(holder))
    metas = getattr(frame, "x_metadatas", None) or ()
    if i is None or i >= len(metas) or not isinstance(metas[i], dict) or "shape" not in metas[i]:
        return {"region": rec[0], "index": i, "shape": None, "dtype": None, "nbytes": 0, "frame_bytes": rec[3]}
    meta = metas[i]
    shape = [int(s) for s in meta["shape"]]
    dtype = meta.get("dtype", torch.float32)
    n = 1
    for s in shape:
        n *= s
    return {
        "region": rec[0],
        "index": i,
        "shape": shape,
        "dtype": dtype_str(dtype),
        "nbytes": n * (dtype.itemsize if hasattr(dtype, "itemsize") else 4),
        "frame_bytes": rec[3],
    }


def _frame_tensor_bytes(frame) -> int:
    """Bytes of tensors the frame's recompute closure keeps besides its inputs: the RNG states saved by
    ``preserve_rng_state=True`` (5,056 bytes for the CPU generator), freed with the frame."""
    total = 0
    for cell in getattr(getattr(frame, "recompute_fn", None), "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, torch.Tensor) and not v.requires_grad:
                try:
                    total += v.untyped_storage().nbytes()
                except (RuntimeError, NotImplementedError):
                    pass
    return total


# NOTE [reentrant layers]: what a reentrant checkpoint's backward will recompute, when it can be known
# without running anything. ``checkpoint(fn, x, use_reentrant=True)`` runs ``fn`` under no_grad in the
# forward, so no graph records its ops; when ``fn`` is an ``nn.Sequential`` (nested ones too) of modules
# whose forward is torch's own (exact types, no hooks), the ops follow from the modules' types and
# attributes. Anything else (a custom forward, an in-place activation, dropout in training, hooks) gives None.
_ELEMENTWISE = {
    "ReLU": "ReluBackward0",
    "GELU": "GeluBackward0",
    "Tanh": "TanhBackward0",
    "Sigmoid": "SigmoidBackward0",
    "SiLU": "SiluBackward0",
}


def reentrant_recompute(node, module) -> dict:
    """``{"layers": region_layers(module) or None, "rng_bytes": n}`` for a ``CheckpointFunctionBackward``
    node: ``n`` is the size of the CPU generator state the forward stashed (``ctx.fwd_cpu_state``, alive as
    long as the node) and that its backward copies again (``fork_rng``) when it preserves the RNG state."""
    layers = region_layers(module) if module is not None else None
    state = getattr(node, "fwd_cpu_state", None) if getattr(node, "preserve_rng_state", False) else None
    try:
        rng = state.untyped_storage().nbytes() if isinstance(state, torch.Tensor) else 0
    except (RuntimeError, NotImplementedError):
        rng = 0
    return {"layers": layers, "rng_bytes": int(rng)}


def region_layers(module) -> list | None:
    """Plain-data layers of a reentrant checkpoint's ``nn.Sequential`` (see NOTE [reentrant layers])."""
    out: list = []
    nn = torch.nn

    def hooked(m) -> bool:
        return bool(m._forward_hooks or m._forward_pre_hooks or getattr(m, "_backward_hooks", None))

    def visit(m) -> bool:
        if hooked(m):
            return False
        t = type(m)
        if t is nn.Sequential:
            return all(visit(c) for c in m)
        if t is nn.Identity:
            return True
        if t is nn.Linear:
            w, b = m.weight, m.bias
            has_b = b is not None
            dtype = dtype_str(w.dtype)
            out.append(
                [
                    "linear",
                    m.in_features,
                    m.out_features,
                    dtype,
                    has_b,
                    w.requires_grad,
                    w.grad is not None,
                    has_b and b.requires_grad,
                    has_b and b.grad is not None,
                ]
            )
            return True
        if t.__module__.startswith("torch.nn.") and t.__name__ in _ELEMENTWISE and not getattr(m, "inplace", False):
            if t.__name__ == "GELU" and m.approximate != "none":
                return False
            out.append([_ELEMENTWISE[t.__name__]])
            return True
        if t is nn.Dropout:  # in training its CPU kernel makes a float mask and products: not modelled
            return not (m.training and m.p > 0)
        return False

    try:
        return out if isinstance(module, nn.Module) and visit(module) and out else None
    except (AttributeError, TypeError):
        return None
