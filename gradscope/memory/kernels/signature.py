"""What one backward node's in-node memory depends on, as plain data (NOTE [in-node memory]).

A signature holds everything needed to run the node's backward again on fresh tensors: the op, its saved
tensors (shape, strides, dtype), its saved non-tensor values, the shape and dtype of each input that needs
a gradient (the outputs of the nodes it sends gradients to), and the layout of each gradient it receives
(contiguous, unless the node that sends it is a transpose, a permute or a sum, whose gradient is a view).
Two nodes with equal signatures allocate the same in-node memory, so one measurement serves both.
"""

from __future__ import annotations

import json

__all__ = ["node_signature", "signature_key", "tensors_of"]

_SUMS = ("SumBackward0",)
#: Backward formulas that hand out views of the gradient they receive: ``cat`` a narrowed slice per
#: input, ``stack`` one ``select`` per input (docs/internals.md#what-one-node-does-to-memory).
_PIECES = ("CatBackward0", "StackBackward0")
_TRANSPOSES = ("TransposeBackward0", "TransposeBackward1")


def signature_key(sig: dict) -> str:
    """The cache key of a signature: its JSON text, keys sorted."""
    return json.dumps(sig, sort_keys=True, separators=(",", ":"))


def _contiguous(shape: list) -> list:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return out[::-1]


_VIEWS = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "SqueezeBackward0", "UnsqueezeBackward0")


def _permuted(shape: list, dims: list) -> list:
    """Strides of ``t.permute(inverse(dims))`` where ``t`` is contiguous of shape ``shape.permute(dims)``."""
    y_stride = _contiguous([shape[d] for d in dims])
    out = [0] * len(shape)
    for i, d in enumerate(dims):
        out[d] = y_stride[i]
    return out


def _swap(shape: list, d0: int, d1: int) -> list:
    dims = list(range(len(shape)))
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return _permuted(shape, dims)


def _layout_of_view_op(prog, u: int, shape: list) -> list | None:
    """Strides of a tensor of ``shape`` that node ``u``'s op made as a transposed or permuted view."""
    name = prog.name[u]
    if not shape or prog.leaf[u]:
        return None
    a = prog.attrs[u].get("attrs") or {} if name in _TRANSPOSES or name == "PermuteBackward0" else {}
    if name == "PermuteBackward0" and isinstance(a.get("dims"), list) and len(a["dims"]) == len(shape):
        return _permuted(shape, [int(d) % len(shape) for d in a["dims"]])
    if name in _TRANSPOSES and "dim0" in a and "dim1" in a:
        return _swap(shape, int(a["dim0"]) % len(shape), int(a["dim1"]) % len(shape))
    if name == "TBackward0" and len(shape) == 2:
        return _swap(shape, 0, 1)
    return None


def _grad_stride(prog, consumers: dict, v: int, k: int, shape: list, depth: int = 0) -> list | None:
    """Strides of the gradient node ``v`` receives for output ``k`` (None: contiguous). A transpose or
    permute sends a view of its own gradient; ``sum()`` an expanded scalar (zero strides, kept through
    views); a pointwise formula (output shaped as its gradient) follows the layout of the gradient it
    received, or, when that one is expanded, of the tensor it saved with that shape (TensorIterator)."""
    users: list = consumers.get((v, k)) or []
    if len(users) != 1 or depth > 16:
        return None
    c = users[0]
    via = _layout_of_view_op(prog, c, shape)
    if via is not None:
        return via
    name = prog.name[c]
    if name in _SUMS and not (prog.attrs[c].get("attrs") or {}).get("dim"):
        return [0] * len(shape)
    out = (prog.grad_shapes[c] or [None])[0]
    if name in _PIECES and out is not None:
        return _piece_stride(prog, consumers, c, list(out), shape, depth)
    if name in _VIEWS and out is not None:  # a view of the gradient of a view: laid out as the output was
        up = _grad_stride(prog, consumers, c, 0, list(out), depth + 1)
        if up is not None and not any(up):
            return [0] * len(shape)
        return _own_output_stride(prog, v, shape)
    if out is None or list(out) != list(shape) or not _pointwise(prog, c, shape):
        return None
    up = _grad_stride(prog, consumers, c, 0, list(out), depth + 1)
    if up is None or any(up):
        return up
    for e in prog.attrs[c].get("saved") or ():
        if e.get("shape") == list(shape):
            return list(e["stride"]) if e.get("stride") else None
    return up


def _piece_stride(prog, consumers: dict, c: int, out: list, shape: list, depth: int) -> list | None:
    """Strides of one input's gradient from ``cat`` / ``stack`` node ``c``: a slice of the gradient ``c``
    received (shape ``out``), so the strides of that whole gradient (``stack``: without its ``dim``)."""
    whole = _grad_stride(prog, consumers, c, 0, out, depth + 1) or _contiguous(out)
    if prog.name[c] == "StackBackward0":
        dim = int((prog.attrs[c].get("attrs") or {}).get("dim", 0)) % max(len(out), 1)
        whole = whole[:dim] + whole[dim + 1 :]
    if len(whole) != len(shape) or whole == _contiguous(shape):
        return None
    return whole


def _pointwise(prog, c: int, shape: list) -> bool:
    """Whether node ``c`` looks like a pointwise formula at ``shape``: every tensor it saved broadcasts to
    it (an RNN's weights or a convolution's do not), so TensorIterator lays its gradient out as its inputs."""
    for e in prog.attrs[c].get("saved") or ():
        sh = e.get("shape")
        if sh is None or len(sh) > len(shape):
            return False
        if any(int(a) not in (1, int(b)) for a, b in zip(reversed(sh), reversed(shape))):
            return False
    return True


def _own_output_stride(prog, v: int, shape: list) -> list | None:
    """The strides of node ``v``'s output when it saved it (``result``, ``output``) and it is not contiguous."""
    for e in prog.attrs[v].get("saved") or ():
        if e.get("slot") in ("result", "result0", "output", "out") and e.get("shape") == shape and e.get("stride"):
            return list(e["stride"])
    return None


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
        inputs.append([int(pos), list(shapes[k]), _dtype_of(prog, u, k), _layout_of_view_op(prog, u, list(shapes[k]))])
    grads = []
    outs = d.get("out_shapes") or []
    dts = d.get("out_dtypes") or []
    for k, shape in enumerate(outs):
        users = consumers.get((v, k))
        if not users and not (k == 0 and v in prog.roots):
            continue
        if shape is None:
            return None
        stride = _grad_stride(prog, consumers, v, k, list(shape))
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


def consumers_of(prog) -> dict:
    """``(node, output) -> [nodes consuming it]`` over a compiled program."""
    cons: dict = {}
    for u, es in enumerate(prog.edges):
        for t, k in es:
            cons.setdefault((t, k), []).append(u)
    return cons


def tensors_of(sig: dict) -> list:
    """``[(shape, dtype)]`` of every tensor the signature makes (saved, inputs, gradients); saved outputs
    (``result``...) are left out: the rebuilt forward makes them again (an RNN's reserve buffer)."""
    out = [(s[1], s[3]) for s in sig["saved"] if not s[0].startswith("result")]
    out += [(i[1], i[2]) for i in sig["inputs"]]
    out += [(g[1], g[3]) for g in sig["grads"]]
    return out


__all__ += ["consumers_of"]
