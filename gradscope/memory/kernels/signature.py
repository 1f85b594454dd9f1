"""What one backward node's in-node memory depends on, as plain data (NOTE [in-node memory]).

A signature holds everything needed to run the node's backward again on fresh tensors: the op, its saved
tensors (shape, strides, dtype), its saved non-tensor values, the shape and dtype of each input that needs
a gradient (the outputs of the nodes it sends gradients to), and the layout of each gradient it receives
(``layout.py``: NOTE [gradient layout]).
Two nodes with equal signatures allocate the same in-node memory, so one measurement serves both.
"""

from __future__ import annotations

import json

from gradscope.memory.kernels.facts import facts
from gradscope.memory.kernels.layout import VIEW_OPS, consumers_of, grad_stride, layout_of_view_op
from gradscope.memory.kernels.reuse import signatures

__all__ = ["keyed_signature", "node_signature", "signature_key", "tensors_of"]


_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def signature_key(sig: dict) -> str:
    """The cache key of a signature: its JSON text, keys sorted."""
    return _JSON.encode(sig)


def _saved(f, v: int) -> list | None:
    """The signature's saved part of node ``v`` (None when a shape it needs is unknown)."""
    saved = []
    for slot, shape, stride, dtype, scalar, status in f.slots(v):
        if shape is None:
            if status in ("live", "stale", "hooked", "offloaded", "recomputed"):
                return None
            continue
        saved.append([slot, list(shape), stride, dtype or "float32", scalar])
    return saved


def _context(prog, f, v: int, consumers: dict) -> tuple | None:
    """``(inputs, gradients)`` of op node ``v``'s signature as tuples: per input that needs a gradient
    ``(position, shape, dtype, layout)``, per gradient received ``(output, strides)`` (None when a shape it
    needs is unknown)."""
    inputs = []
    names, grad_shapes = prog.name, prog.grad_shapes
    for (u, k), pos in zip(prog.edges[v], prog.needs[v]):
        shapes = grad_shapes[u]
        if k >= len(shapes) or shapes[k] is None:
            return None
        shape = shapes[k]
        lay = layout_of_view_op(prog, u, shape) if names[u] in VIEW_OPS else None
        inputs.append((int(pos), tuple(shape), f.dtype(u, k), None if lay is None else tuple(lay)))
    grads: list = []
    for k, shape in enumerate(f.outputs(v)[0]):
        if not consumers.get((v, k)) and not (k == 0 and v in prog.roots):
            continue
        if shape is None:
            return None
        stride = grad_stride(prog, consumers, v, k, list(shape))
        if stride is None:
            grads.append((k, None))
        elif not any(stride) and not f.function(v):  # an expanded gradient: the replay counts a built-in
            grads.append((k, None))  # formula's copy of it (memory/replay/gradients.py) and measures the
            # formula on a dense one; user code is measured on the expanded one itself
        else:
            grads.append((k, tuple(stride)))
    return tuple(inputs), tuple(grads)


def node_signature(prog, v: int, consumers: dict, threads: int) -> dict | None:
    """The signature of op node ``v`` of a compiled program (None when a shape it needs is unknown).

    ``consumers`` maps ``(node, output)`` to the nodes that consume that output (``consumers_of``).
    """
    got = keyed_signature(prog, v, consumers, threads)
    return None if got is None else got[1]


def keyed_signature(prog, v: int, consumers: dict, threads: int) -> tuple | None:
    """``(signature_key(sig), sig)`` of op node ``v`` (:func:`node_signature`), or None. Built from parts
    (NOTE [node facts]): the node's own digest (``raw_key``), its inputs and the layouts of the gradients
    it receives, as tuples, look up the JSON key of a signature built from the same parts before
    (``reuse.signatures``), so the JSON text is written once per distinct signature."""
    f = facts(prog)
    raw = f.raw_key(v)
    saved = None
    if raw is None:  # a node read from its dict: a saved shape may be unknown (the columns' never are)
        saved = _saved(f, v)
        if saved is None:
            return None
    ctx = _context(prog, f, v, consumers)
    if ctx is None:
        return None
    memo = None
    if raw is not None:
        memo = signatures()
        try:
            got = memo.get((raw, ctx, threads))
        except TypeError:  # an unhashable value: built each time
            got = memo = None
        if got is not None:
            return got
    outs, dts = f.outputs(v)
    sig = {
        "op": prog.name[v],
        "saved": _saved(f, v) if saved is None else saved,
        "attrs": f.values(v) or {},
        "inputs": [[pos, list(shape), dt, None if lay is None else list(lay)] for pos, shape, dt, lay in ctx[0]],
        "grads": [
            [k, list(outs[k]), None if st is None else list(st), dts[k] if k < len(dts) else "float32"]
            for k, st in ctx[1]
        ],
        "n_out": len(outs),
        "threads": threads,
    }
    fn = f.function(v)
    if fn:  # user code: the shape of every output, for the zero gradients torch makes for unused ones
        sig["function"] = fn
        sig["outs"] = [[None if s is None else list(s), dts[k] if k < len(dts) else "float32"]
                       for k, s in enumerate(outs)]  # fmt: skip
    got = (signature_key(sig), sig)
    if memo is not None:
        memo[(raw, ctx, threads)] = got
    return got


def tensors_of(sig: dict) -> list:
    """``[(shape, dtype)]`` of every tensor the signature makes (saved, inputs, gradients); saved outputs
    (``result``...) are left out: the rebuilt forward makes them again (an RNN's reserve buffer)."""
    out = [(s[1], s[3]) for s in sig["saved"] if not s[0].startswith("result")]
    out += [(i[1], i[2]) for i in sig["inputs"]]
    out += [(g[1], g[3]) for g in sig["grads"]]
    return out


__all__ += ["consumers_of"]
