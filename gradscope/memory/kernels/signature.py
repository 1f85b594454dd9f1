"""What one backward node's in-node memory depends on, as plain data (NOTE [in-node memory]).

A signature holds everything needed to run the node's backward again on fresh tensors: the op, its saved
tensors (shape, strides, dtype), its saved non-tensor values, the shape and dtype of each input that needs
a gradient (the outputs of the nodes it sends gradients to), and the layout of each gradient it receives
(``layout.py``: NOTE [gradient layout]).
Two nodes with equal signatures allocate the same in-node memory, so one measurement serves both.
"""

from __future__ import annotations

import json

from gradscope.memory.kernels.layout import consumers_of, grad_stride, layout_of_view_op

__all__ = ["node_signature", "signature_key", "tensors_of"]


def signature_key(sig: dict) -> str:
    """The cache key of a signature: its JSON text, keys sorted."""
    return json.dumps(sig, sort_keys=True, separators=(",", ":"))


def _dtype_of(prog, u: int, k: int) -> str:
    d = prog.attrs[u]
    if prog.leaf[u]:
        return d.get("dtype") or "float32"
    dts = d.get("out_dtypes") or []
    return dts[k] if k < len(dts) and dts[k] else "float32"


def node_signature(prog, v: int, consumers: dict, threads: int) -> dict | None:
    """The signature of op node ``v`` of a compiled program (None when a shape it needs is unknown).

    ``consumers`` maps ``(node, output)`` to the nodes that consume that output (``consumers_of``).
    """
    d = prog.attrs[v]
    saved = []
    for e in d.get("saved") or ():
        if e.get("shape") is None:
            if e.get("status") in ("live", "stale", "hooked", "offloaded", "recomputed"):
                return None
            continue
        saved.append([e["slot"], list(e["shape"]), e.get("stride"), e.get("dtype") or "float32", bool(e.get("scalar"))])
    inputs = []
    for (u, k), pos in zip(prog.edges[v], prog.needs[v]):
        shapes = prog.grad_shapes[u]
        if k >= len(shapes) or shapes[k] is None:
            return None
        inputs.append([int(pos), list(shapes[k]), _dtype_of(prog, u, k), layout_of_view_op(prog, u, list(shapes[k]))])
    grads = []
    outs = d.get("out_shapes") or []
    dts = d.get("out_dtypes") or []
    for k, shape in enumerate(outs):
        users = consumers.get((v, k))
        if not users and not (k == 0 and v in prog.roots):
            continue
        if shape is None:
            return None
        stride = grad_stride(prog, consumers, v, k, list(shape))
        if stride is not None and not any(stride) and not d.get("function"):  # an expanded gradient: the
            stride = None  # replay counts a built-in formula's copy of it (memory/replay/gradients.py) and
            # measures the formula on a dense one; user code is measured on the expanded one itself
        grads.append([k, list(shape), stride, dts[k] if k < len(dts) else "float32"])
    sig = {
        "op": prog.name[v],
        "saved": saved,
        "attrs": d.get("attrs") or {},
        "inputs": inputs,
        "grads": grads,
        "n_out": len(outs),
        "threads": threads,
    }
    if d.get("function"):
        sig["function"] = d["function"]
    return sig


def tensors_of(sig: dict) -> list:
    """``[(shape, dtype)]`` of every tensor the signature makes (saved, inputs, gradients); saved outputs
    (``result``...) are left out: the rebuilt forward makes them again (an RNN's reserve buffer)."""
    out = [(s[1], s[3]) for s in sig["saved"] if not s[0].startswith("result")]
    out += [(i[1], i[2]) for i in sig["inputs"]]
    out += [(g[1], g[3]) for g in sig["grads"]]
    return out


__all__ += ["consumers_of"]
