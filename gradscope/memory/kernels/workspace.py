"""Kernel workspace: memory a backward kernel allocates and frees inside one node (no graph shows it).

NOTE [workspace calibration]
On CPU, ``convolution_backward`` (oneDNN reorders and scratchpads), RNN backward
(``MkldnnRnnLayerBackward0``), attention backward, layer/batch norm backward, broadcasting ``mul`` and
``pow`` allocate temporaries that are freed before the node returns; their size depends on the op, the
shapes, the dtype, the thread count and the algorithm oneDNN picks, so no closed formula holds (conv:
81,912 bytes at batch 1, 98,296 at 4, 196,600 at 8 for the same layer). gradscope measures it: for each
(op, shapes, dtype, attributes, threads) the op is run once on random CPU tensors of those shapes under
``torch.profiler`` and the node's in-node peak minus its outputs is the workspace. Results are cached per
machine in ``~/.cache/gradscope/workspace-<torch>.json`` (``GRADSCOPE_CACHE`` overrides the folder). An op
whose tensors exceed :data:`LIMIT` (or that lives on ``meta``/an accelerator) is measured at two smaller
batch sizes and extrapolated linearly in the batch. Ops outside :data:`BUILDERS` count no workspace.
Set ``GRADSCOPE_WORKSPACE=0`` to switch measuring off (cached values are still used).
"""

from __future__ import annotations

import json
import os

from gradscope.memory.replay.engine import numel_bytes

__all__ = ["node_workspace", "LIMIT", "cache_path"]

#: Above this many bytes of tensors an op is measured at smaller batches and extrapolated.
LIMIT = 32 * 1024 * 1024

_MEMO: dict = {}
_LOADED = [False]


def cache_path() -> str:
    import torch

    folder = os.environ.get("GRADSCOPE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gradscope")
    return os.path.join(folder, f"workspace-{torch.__version__.split('+')[0]}.json")


def _load() -> None:
    if _LOADED[0]:
        return
    _LOADED[0] = True
    try:
        with open(cache_path()) as f:
            _MEMO.update(json.load(f))
    except (OSError, ValueError):
        pass


def _save() -> None:
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(_MEMO, f)
        os.replace(tmp, path)
    except OSError:
        pass


def _slot(d: dict, name: str):
    for e in d.get("saved") or ():
        if e.get("slot") == name:
            return e
    return None


def _spec(prog, v: int):
    """``(op, tensors: {slot: (shape, dtype)}, attrs)`` for an op in BUILDERS, else None."""
    from gradscope.memory.kernels.calibrate import BUILDERS

    name = prog.name[v]
    if name not in BUILDERS:
        return None
    d = prog.attrs[v]
    tensors = {}
    for e in d.get("saved") or ():
        if e.get("shape") is not None and not e.get("scalar"):
            tensors[e["slot"]] = (list(e["shape"]), e.get("dtype") or "float32")
    outs = d.get("out_shapes") or []
    dts = d.get("out_dtypes") or []
    tensors["grad"] = (list(outs[0]) if outs else [], dts[0] if dts else "float32")
    attrs = dict(d.get("attrs") or {})
    flag = _neighbours(prog, v, name)
    if attrs.get("batch_first"):  # only the layer whose output goes through transpose(0, 1) gets it batch-major
        attrs["grad_batch_major"] = flag
    if name.startswith("ScaledDotProduct"):
        attrs["heads_transposed"] = flag
    return name, tensors, attrs


_TRANSPOSES = ("TransposeBackward0", "TransposeBackward1")


def _neighbours(prog, v: int, name: str) -> bool | None:
    """What an op's workspace depends on besides its own attributes: for RNN, whether a transpose(0, 1)
    consumes its output (batch-major gradient); for attention, whether its query comes from a
    transpose(1, 2) (heads split by HF / nanoGPT, or not as in nn.MHA). None for other ops."""
    if name.startswith("ScaledDotProduct"):
        q = [u for (u, _), pos in zip(prog.edges[v], prog.needs[v]) if pos == 0]
        return bool(q) and prog.name[q[0]] in _TRANSPOSES
    if name == "MkldnnRnnLayerBackward0":
        return any(prog.name[u] in _TRANSPOSES for u in _consumers(prog).get(v, ()))
    return None


def _consumers(prog) -> dict:
    """Node -> the nodes that consumed its output 0 (their gradient flows into it)."""
    cons = getattr(prog, "_consumers", None)
    if cons is None:
        cons = {}
        for u, es in enumerate(prog.edges):
            for t, k in es:
                if k == 0:
                    cons.setdefault(t, []).append(u)
        prog._consumers = cons
    return cons


#: (compact digest of the node, input positions, threads, neighbour flag) -> (workspace, grad bytes):
#: repeat ops skip building their dict and cache key (the digest holds everything the key is made of)
_FAST: dict = {}


def node_workspace(prog, v: int, grad_scale=None) -> int:
    """Workspace bytes of node ``v`` (see NOTE [workspace calibration]); 0 for ops without a builder."""
    if prog.leaf[v]:
        return 0
    raw = getattr(prog.attrs, "raw_key", None)
    fast = raw(v) if raw is not None else None
    if fast is not None:
        fast = (fast, tuple(prog.needs[v]), _threads(), _neighbours(prog, v, prog.name[v]))
        try:
            got = _FAST.get(fast)
        except TypeError:  # an unhashable value: no memo for this op
            got = fast = None
        if got is not None:
            return _scaled(got[0], got[1], grad_scale, v)
    spec = _spec(prog, v)
    if spec is None:
        return 0
    name, tensors, attrs = spec
    needs = prog.needs[v]
    dtype = tensors["grad"][1]
    scale = 1.0
    full = numel_bytes(tensors["grad"][0], tensors["grad"][1])
    if grad_scale is not None:
        scale = grad_scale(v, 0, full) / full if full else 1.0
    key = repr(
        (name, sorted(tensors.items()), sorted(attrs.items()), needs, _threads(), prog.attrs[v].get("device") or "cpu")
    )
    _load()
    hit = _MEMO.get(key)
    if hit is None:
        if os.environ.get("GRADSCOPE_WORKSPACE", "1") == "0":
            return 0
        from gradscope._torch import profiler_enabled
        from gradscope.memory.kernels.calibrate import measure_workspace

        if profiler_enabled():
            return 0  # a profiler is running: measure another time (nothing cached)
        hit = measure_workspace(name, tensors, attrs, needs, dtype, LIMIT)
        _MEMO[key] = hit = hit or 0  # None: the builder does not apply (no broadcast...): no workspace
        _save()
    if fast is not None:
        if len(_FAST) >= 4096:  # a memo (the calibration cache keeps the measurements): bounded
            _FAST.clear()
        _FAST[fast] = (hit, full)
    return int(round(hit * scale)) if scale != 1.0 else int(hit)


def _scaled(hit, full: int, grad_scale, v: int) -> int:
    if grad_scale is None or not full:
        return int(hit)
    scale = grad_scale(v, 0, full) / full
    return int(round(hit * scale)) if scale != 1.0 else int(hit)


def _threads() -> int:
    if not _NUM_THREADS:
        import torch

        _NUM_THREADS.append(torch.get_num_threads)
    return _NUM_THREADS[0]()


_NUM_THREADS: list = []  # torch.get_num_threads, bound on first use
