"""What a replayed step is made of, in bytes: storage sizes (batch-scaled), the saved storages an offload
moves away, the state that exists before backward (parameters, buffers, inputs, gradients), and the
peak split by module. :func:`gradscope.memory.replay.backward.replay` assembles these around the simulation."""

from __future__ import annotations

from dataclasses import dataclass

from gradscope.graph import BUFFERS, INPUT_STORAGES, PARAMS, ROOT_SHAPES, ROOT_STORAGE_BYTES
from gradscope.memory.replay.engine import Program, numel_bytes
from gradscope.memory.replay.reentrant import ctx_state_bytes

__all__ = [
    "Overrides",
    "storage_sizes",
    "offloaded_keys",
    "grad_names",
    "step_base",
    "batch_bytes",
    "batch_storages",
    "peak_by_module",
    "peak_blocks",
]


@dataclass
class Overrides:
    """Changes to the step that the replay applies (``replay.backward`` explains each field)."""

    offload: frozenset = frozenset()
    scale: object = None
    has_grad: dict | None = None
    target: object = None  # a gradscope.memory.targets.Target (None: the CPU), NOTE [device targets]
    accumulate: int = 1  # micro-steps (backward passes) per optimizer step: NOTE [first and later steps]
    set_to_none: bool = True  # how zero_grad() clears .grad between optimizer steps


def storage_sizes(prog: Program, scale, alloc=None):
    """``(storage key -> bytes, gradient size callable or None)`` with ``scale`` applied, then ``alloc``
    (a device target's ``allocated``: the bytes a block of that size counts on the device)."""
    if alloc is not None:
        base, inner = storage_sizes(prog, scale)
        sizes = {key: alloc(n) for key, n in base.items()}

        def rounded(u, k, nbytes):
            return alloc(inner(u, k, nbytes) if inner is not None else nbytes)

        return sizes, rounded
    if scale is None:
        return prog.storages, None
    sizes = {}
    for key, nbytes in prog.storages.items():
        shape = prog.shapes.get(key)
        sizes[key] = int(scale(shape or [], "float32", nbytes)) if shape is not None else nbytes
    shapes = prog.grad_shapes

    def grad_scale(u, k, nbytes):
        sh = shapes[u][k] if k < len(shapes[u]) else None
        return int(scale(sh or [], "float32", nbytes)) if sh is not None else nbytes

    return sizes, grad_scale


def offloaded_keys(prog: Program, ov: Overrides) -> frozenset:
    """Storage keys kept off the device: saved only by offloaded nodes and not held outside the graph."""
    if not ov.offload:
        return frozenset()
    off = {prog.index[n] for n in ov.offload if n in prog.index}
    holders: dict = {}
    for u, keys in enumerate(prog.saved):
        for key in keys:
            holders.setdefault(key, set()).add(u)
    return frozenset(key for key, us in holders.items() if us <= off and key not in prog.external)


def grad_names(prog: Program, has_grad: dict) -> set:
    info = prog.leaves()
    return {info[i][1] if i in info else prog.attrs[i].get("name") for i, g in has_grad.items() if g}


def step_base(prog: Program, graph, sizes: dict, drop, has_grad: dict, scale, alloc=None, others=None) -> dict:
    """What is alive when backward starts, by kind (bytes); ``alloc`` rounds each tensor as a device would;
    ``others``: whether the parameters the graph does not reach have a ``.grad`` (None: as inspected)."""
    params = graph.graph.get(PARAMS, {})
    if alloc is None:
        alloc = int
    param_keys = set()  # ("s", sid) of each parameter storage
    p_bytes = g_bytes = 0
    info = prog.leaves()
    leaf_names = {name: i for i, (_, name) in info.items()}
    for name, p in params.items():  # one pass: parameter bytes (shared storages once), their .grads
        nbytes = alloc(numel_bytes(p.get("shape"), p.get("dtype")))
        sid = p.get("storage")
        if sid is None:
            p_bytes += nbytes
        elif ("s", sid) not in param_keys:
            p_bytes += nbytes
            param_keys.add(("s", sid))
        i = leaf_names.get(name)
        if has_grad.get(i) if i is not None else (p.get("grad") if others is None else others):
            g_bytes += nbytes
    act = ctx_state_bytes(prog)  # NOTE [reentrant checkpoint backward]: the RNG states the ctx keeps
    for key, nbytes in sizes.items():
        if key in param_keys or key in drop or key[0] == "r":
            continue
        act += nbytes
    inputs = 0
    ids = prog.ids
    saved_inputs = graph.graph.get(INPUT_STORAGES) or {}
    for i, (kind, _) in info.items():
        if kind == "input":
            nbytes = prog.grad_bytes[i][0]
            if has_grad.get(i):
                nbytes = alloc(nbytes)
                g_bytes += nbytes
            sid = saved_inputs.get(ids[i])
            key = ("s", sid)
            if sid is not None and key in sizes and key not in param_keys and key not in drop:
                continue  # an op saved this input: its storage is counted once, among the activations
            inputs += alloc(int(scale(prog.grad_shapes[i][0], "float32", nbytes)) if scale else nbytes)
    shapes, stored = graph.graph.get(ROOT_SHAPES, ()), graph.graph.get(ROOT_STORAGE_BYTES) or ()
    loss = sum(
        alloc(stored[i] if i < len(stored) and stored[i] is not None else numel_bytes(s, "float32"))
        for i, s in enumerate(shapes)
    )  # the loss's storage: MSE's scalar views its whole buffer
    buffers = sum(alloc(n) for sid, n in graph.graph.get(BUFFERS, ()) if sid is None or ("s", sid) not in sizes)
    return {
        "parameters": p_bytes,
        "buffers": buffers,
        "gradients": g_bytes,
        "saved activations and inputs": act,
        "leaf inputs": inputs,
        "loss": loss,
    }


def _tensors(value, out: list) -> list:
    """The tensors in ``value`` (a tensor, or lists / tuples / dicts of them, nested), in order."""
    import torch

    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(reversed(v))
        elif isinstance(v, dict):
            stack.extend(reversed(list(v.values())))
    return out


def batch_bytes(prog: Program, graph, inputs, sizes: dict, drop, ptrs: dict | None, scale) -> int:
    """Bytes of the caller's ``inputs`` (the batch, held across the step) that no other part of the budget
    counts: a storage an op saved is among the activations, an input leaf that requires grad among the
    leaf inputs, a parameter or buffer in its own row; the rest is added once per storage. ``inputs``:
    tensors (or lists / dicts of them), or the traced batch's ``[storage key, bytes, shape, dtype,
    storage id or None]`` records (``graph.BATCH``). ``ptrs``: the walk's ``{storage pointer: storage id}``
    (None after loading a report from JSON: every input counted, never fewer bytes than are alive)."""
    return sum(n for _, n in batch_storages(prog, graph, inputs, sizes, drop, ptrs, scale))


def _storage_records(inputs) -> list:
    """``(storage key, bytes, shape)`` of each tensor in ``inputs`` (or each traced batch record)."""
    from gradscope._torch import storage_key_and_bytes

    out = []
    for t in _tensors(inputs, []):
        try:
            ptr, nbytes = storage_key_and_bytes(t)
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        out.append((ptr, nbytes, list(t.shape)))
    return out


def batch_storages(prog: Program, graph, inputs, sizes: dict, drop, ptrs: dict | None, scale) -> list:
    """``(storage key, bytes)`` of the storages :func:`batch_bytes` counts."""
    params = graph.graph.get(PARAMS, {})
    counted = {("s", p.get("storage")) for p in params.values() if p.get("storage") is not None}
    counted.update(("s", sid) for sid, _ in graph.graph.get(BUFFERS, ()) if sid is not None)
    counted.update(key for key in sizes if key not in drop)
    traced = _is_records(inputs)
    records = inputs if traced else _storage_records(inputs)
    seen: set = set()
    out = []
    for r in records:
        ptr, nbytes, shape = r[:3]
        if ptr in seen:
            continue
        seen.add(ptr)
        if traced:  # the storage id the walk gave it, found when the trace was read (NOTE [the traced batch])
            sid = r[4] if len(r) > 4 else None
        else:
            sid = ptrs.get(ptr) if ptrs else None
        if sid is not None and (sid < 0 or ("s", sid) in counted):
            continue
        out.append((ptr, int(scale(list(shape), "float32", nbytes)) if scale else int(nbytes)))
    return out


def _is_records(inputs) -> bool:
    return (
        isinstance(inputs, list)
        and bool(inputs)
        and all(isinstance(r, list) and len(r) == 5 and isinstance(r[0], int) for r in inputs)
    )


def peak_by_module(prog: Program, snapshot: dict, origin: dict, sizes: dict, drop) -> list[tuple[str, str, int]]:
    """Group the peak's live storages that backward created by the module of the node that made them; a last
    row gives the saved tensors freed before the peak (negative), so that the rows sum to the peak."""
    out: dict = {}
    held = {k for keys in prog.saved for k in keys if k[0] != "r" and k not in drop and k not in prog.external}
    freed = sum(sizes.get(k, 0) for k in held if k not in snapshot)
    for key, nbytes in snapshot.items():
        kind = None
        node = None
        if type(key) is int:  # a gradient's storage (simulate.py keys it by the tensor's id)
            node, kind = origin.get(key), "gradients"
        elif key[0] == "w":
            node, kind = key[1], "workspace"
        elif key[0] == "n":  # a reentrant checkpoint's recompute and nested backward, at their highest
            node, kind = key[1], "reentrant recompute"
        elif key[0] == "k":  # what an earlier reentrant checkpoint's nested backward left: .grads
            node, kind = key[1], "gradients"
        elif key[0] == "r":
            region = prog.regions.get(key[1]) or ()
            node, kind = (min(region) if region else None), "recomputed activations"
        if kind is None or not nbytes:
            continue
        mod = (prog.module[node] if node is not None else None) or ("(seed)" if node is None else "(no module)")
        if node is not None and prog.leaf[node]:
            mod = prog.attrs[node].get("module") or prog.attrs[node].get("name") or "(no module)"
        out[(mod, kind)] = out.get((mod, kind), 0) + nbytes
    rows = sorted(((m, k, b) for (m, k), b in out.items()), key=lambda r: -r[2])
    if freed:
        rows.append(("(saved tensors freed before the peak)", "freed", -freed))
    return rows


#: The parts of ``step_base`` held as storages the replay does not list one by one.
_WHOLE = ("parameters", "saved activations and inputs")


def peak_blocks(graph, snapshot: dict, parts: dict, alloc=None) -> list[int]:
    """The sizes of the blocks alive at backward's peak, for a device target's ``reserved()`` estimate: what
    the replay's snapshot holds, each parameter, and every other part of the step's base as one block
    (the optimizer's new state and its temporaries, which come later, are not included)."""
    alloc = alloc or int
    params = graph.graph.get(PARAMS, {})
    blocks, seen = [], set()
    for p in params.values():
        sid = p.get("storage")
        if sid is None or sid not in seen:
            seen.add(sid)
            blocks.append(alloc(numel_bytes(p.get("shape"), p.get("dtype"))))
    blocks += [n for key, n in snapshot.items() if n > 0 and not (type(key) is tuple and key[1] in seen)]
    blocks += [n for name, n in parts.items() if name not in _WHOLE and n > 0]
    return blocks
