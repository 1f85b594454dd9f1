"""Measuring one op's backward workspace on small CPU tensors (see NOTE [workspace calibration]).

Each builder re-creates the op from the node's saved shapes and attributes on fresh random tensors
(never the user's), so the measurement touches nothing the user holds. ``needs`` lists the op's input
positions that require grad (the node's edges).
"""

from __future__ import annotations

import torch

from gradscope._torch import PROFILER_ALLOCATION, profiler_enabled

__all__ = ["BUILDERS", "measure_workspace"]

_EVAL = "autograd::engine::evaluate_function: "


def _t(spec, requires_grad=False, batch=None):
    shape, dtype = spec
    shape = list(shape)
    if batch is not None and shape:
        shape[0] = batch
    dt = getattr(torch, dtype, torch.float32)
    if dt.is_floating_point:
        return torch.randn(shape, dtype=dt).requires_grad_(requires_grad)
    return torch.zeros(shape, dtype=dt)


def _conv(ts, a, needs, batch):
    x = _t(ts["input"], 0 in needs, batch)
    w = _t(ts["weight"], 1 in needs)
    bias_n = (a.get("bias_sym_sizes_opt") or [0])[0]
    b = torch.randn(bias_n, requires_grad=2 in needs) if bias_n else None
    out = torch.convolution(
        x, w, b, a["stride"], a["padding"], a["dilation"], a["transposed"], a["output_padding"], a["groups"]
    )
    return out, [t for t in (x, w, b) if t is not None and t.requires_grad]


def _layer_norm(ts, a, needs, batch):
    x = _t(ts["input"], 0 in needs, batch)
    w = _t(ts["weight"], 1 in needs) if "weight" in ts else None
    b = _t(ts["bias"], 2 in needs) if "bias" in ts else None
    out = torch.native_layer_norm(x, a["normalized_shape"], w, b, 1e-5)[0]
    return out, [t for t in (x, w, b) if t is not None and t.requires_grad]


def _batch_norm(ts, a, needs, batch):
    x = _t(ts["input"], 0 in needs, batch)
    c = x.shape[1]
    w = torch.ones(c, requires_grad=1 in needs)
    b = torch.zeros(c, requires_grad=2 in needs)
    out = torch.nn.functional.batch_norm(x, torch.zeros(c), torch.ones(c), w, b, training=bool(a.get("training", True)))
    return out, [t for t in (x, w, b) if t.requires_grad]


def _rnn(ts, a, needs, batch):
    x = _t(ts["input"], 0 in needs)
    ws = [_t(ts[f"weight{i}"], (i + 1) in needs) for i in range(4)]
    hx, cx = _t(ts["hx_"]), _t(ts["cx_"])
    out = torch.mkldnn_rnn_layer(
        x,
        ws[0],
        ws[1],
        ws[2],
        ws[3],
        hx,
        cx,
        a["reverse"],
        a["batch_sizes"],
        a["mode"],
        a["hidden_size"],
        a["num_layers"],
        a["has_biases"],
        a["bidirectional"],
        a["batch_first"],
        a["train"],
    )[0]
    # batch_first: the layer runs time-major and its output goes back through transpose(0, 1), so its
    # gradient arrives batch-major
    return out, [t for t in (x, *ws) if t.requires_grad], "batch_major" if a.get("grad_batch_major") else None


def _bthd(spec, requires_grad, batch):
    """A [B, H, T, D] tensor laid out as [B, T, H, D] (heads split from a projection, then transposed)."""
    shape, dtype = spec
    shape = list(shape)
    if batch is not None:
        shape[0] = batch
    base = torch.randn([shape[0], shape[2], shape[1], shape[3]], dtype=getattr(torch, dtype, torch.float32))
    return base.requires_grad_(requires_grad)


def _sdpa(ts, a, needs, batch):
    # Heads split by .transpose(1, 2) (HF, nanoGPT): q, k, v are head-split views of [B, T, H*D]
    # projections and the output goes back through transpose(1, 2), so its gradient arrives as a
    # [B, T, H, D]-contiguous tensor too. Otherwise (nn.MultiheadAttention) plain tensors.
    if not a.get("heads_transposed", True):
        q, k, v = (_t(ts[n], i in needs, batch) for i, n in enumerate(("query", "key", "value")))
        out = torch._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, a.get("dropout_p", 0.0), bool(a.get("is_causal")), scale=a.get("scale")
        )[0]
        return out, [t for t in (q, k, v) if t.requires_grad]
    leaves = [_bthd(ts[n], i in needs, batch) for i, n in enumerate(("query", "key", "value"))]
    q, k, v = (t.transpose(1, 2) for t in leaves)
    out = torch._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, a.get("dropout_p", 0.0), bool(a.get("is_causal")), scale=a.get("scale")
    )[0]
    return out, [t for t in leaves if t.requires_grad], "bthd"


def _embedding(ts, a, needs, batch):
    idx = _t(ts["indices"], batch=batch)
    w = torch.randn(a["weight_sym_argsize_0"], ts["grad"][0][-1], requires_grad=True)
    return torch.nn.functional.embedding(idx, w, a.get("padding_idx", -1)), [w]


def _mul(ts, a, needs, batch):
    if "self" not in ts or "other" not in ts or ts["self"][0] == ts["other"][0]:
        return None  # no broadcast: the formula makes only its outputs
    n = len(ts["grad"][0])
    x = _t(ts["self"], 0 in needs, batch if len(ts["self"][0]) == n else None)
    y = _t(ts["other"], 1 in needs, batch if len(ts["other"][0]) == n else None)
    return x * y, [t for t in (x, y) if t.requires_grad]


def _pow(ts, a, needs, batch):
    x = _t(ts["self"], True, batch)
    return x.pow(a["exponent"]), [x]


BUILDERS = {
    "ConvolutionBackward0": _conv,
    "NativeLayerNormBackward0": _layer_norm,
    "NativeBatchNormBackward0": _batch_norm,
    "MkldnnRnnLayerBackward0": _rnn,
    "ScaledDotProductFlashAttentionForCpuBackward0": _sdpa,
    "EmbeddingBackward0": _embedding,
    "MulBackward0": _mul,
    "PowBackward0": _pow,
}


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _once(name, tensors, attrs, needs, batch) -> int | None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        built = BUILDERS[name](tensors, attrs, needs, batch)
        if built is None:
            return None
        out, leaves = built[0], built[1]
        layout = built[2] if len(built) > 2 else None
        if layout == "bthd":  # the gradient in the [B, T, H, D] layout
            grad = torch.randn(out.shape[0], out.shape[2], out.shape[1], out.shape[3]).transpose(1, 2)
        elif layout == "batch_major":
            grad = torch.randn(out.shape[1], out.shape[0], *out.shape[2:]).transpose(0, 1)
        else:
            grad = torch.randn_like(out)
        torch.autograd.backward(out, grad)
    tree = prof.profiler.kineto_results.experimental_event_tree()
    best = None
    stack = list(tree)
    while stack:
        node = stack.pop()
        if node.name.startswith(_EVAL) and node.name.endswith(name):
            run = high = 0
            events = []
            sub = [node]
            while sub:
                n = sub.pop()
                if n.typed[0] == PROFILER_ALLOCATION:
                    events.append((n.start_time_ns, int(n.typed[1].alloc_size)))
                sub.extend(n.children)
            for _, b in sorted(events):
                run += b
                high = max(high, run)
            best = high
            break
        stack.extend(node.children)
    if best is None:
        return None
    outs = sum(_nbytes(t) for t in leaves)
    return max(0, best - outs)


def measure_workspace(name, tensors, attrs, needs, dtype, limit) -> int | None:
    """Workspace of op ``name`` at these shapes (bytes), extrapolated in the batch above ``limit``."""
    if needs is None:
        needs = [0, 1, 2, 3, 4]
    if profiler_enabled():
        return None  # a profiler is running (the user's): measure another time
    total = sum(_nbytes_of(s) for s in tensors.values())
    try:
        if total <= limit and all(dt in _FLOATS or not str(dt).startswith("float") for _, dt in tensors.values()):
            return _once(name, tensors, attrs, needs, None)
        b = int(tensors["grad"][0][0]) if tensors["grad"][0] else 1
        small = max(1, int(b * limit / max(total, 1)))
        lo, hi = max(1, small // 2), max(2, small)
        w_lo, w_hi = _once(name, tensors, attrs, needs, lo), _once(name, tensors, attrs, needs, hi)
        if w_lo is None or w_hi is None:
            return None
        return max(0, int(w_hi + (w_hi - w_lo) * (b - hi) / max(hi - lo, 1)))
    except (RuntimeError, TypeError, ValueError, KeyError, IndexError):
        return None


_FLOATS = {"float32", "float64", "bfloat16", "float16"}  # gradscope dtype strings (graph attributes)


def _nbytes_of(spec) -> int:
    from gradscope.memory.replay.engine import numel_bytes

    return numel_bytes(spec[0], spec[1])
