"""The forward FLOPs of every op node, estimated from the shapes the graph holds: what a recompute costs.

A checkpointed module runs its forward twice, so the price of checkpointing it is its forward's FLOPs. The
graph has no timings (``trace()`` records no clock), but it has, for each op, its name, the shapes of the
tensors it saved and of its outputs (``out_shapes``), which is what a FLOP count needs:

    matrix products   (Mm, Addmm, Bmm, Baddbmm)      2 * M * K * N (per batch entry)
    convolution       (ConvolutionBackward0)          2 * numel(output) * numel(weight[0])
    attention         (ScaledDotProduct*Backward0)    4 * B * H * T * S * D
    recurrent layers  (MkldnnRnnLayer, CudnnRnn)      2 * T * B * (numel(w_ih) + numel(w_hh)) per layer
    view-like ops     (View, Transpose, Expand, ...)  0
    everything else                                   numel of its outputs (one FLOP per element)

The estimate ranks modules against each other (which block is the cheapest to recompute) and says what
share of the forward a plan recomputes; it is not a time. Ops that never entered the graph (work on tensors
that do not require grad) are not counted.
"""

from __future__ import annotations

from math import prod

__all__ = ["node_flops", "forward_flops", "FORWARD_VIEWS"]

#: Backward nodes of forward ops whose output is a view of their input (no new memory, no FLOPs).
FORWARD_VIEWS = frozenset(
    {
        "AliasBackward0",
        "AsStridedBackward0",
        "ExpandBackward0",
        "PermuteBackward0",
        "ReshapeAliasBackward0",
        "SelectBackward0",
        "SliceBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "TBackward0",
        "TransposeBackward0",
        "TransposeBackward1",
        "UnsafeViewBackward0",
        "UnsqueezeBackward0",
        "ViewBackward0",
    }
)
#: Ops that cost no FLOPs: the views, plus splits, copies and detaches.
_FREE = FORWARD_VIEWS | frozenset(
    {
        "ChunkBackward0",
        "CloneBackward0",
        "DetachBackward0",
        "NarrowBackward0",
        "SplitBackward0",
        "SplitWithSizesBackward0",
        "ToCopyBackward0",
        "UnbindBackward0",
        "UnfoldBackward0",
    }
)


def _saved(data) -> dict[str, list]:
    return {e["slot"]: e["shape"] for e in data.get("saved", ()) if e.get("shape") is not None}


def _out_numel(data) -> int:
    return sum(prod(s) for s in (data.get("out_shapes") or ()) if s is not None)


def node_flops(data) -> int:
    """Estimated forward FLOPs of one op node (its graph attributes ``data``); see the module docstring."""
    name = data.get("name") or ""
    if data.get("kind") != "op" or name in _FREE:
        return 0
    saved = _saved(data)
    out = _out_numel(data)
    if name in ("MmBackward0", "AddmmBackward0", "BmmBackward0", "BaddbmmBackward0", "AddbmmBackward0"):
        a = saved.get("mat1") or saved.get("self") or saved.get("batch1")
        if a:
            return 2 * out * a[-1]
        b = saved.get("mat2") or saved.get("batch2")
        if b and len(b) >= 2:
            return 2 * out * b[-2]
    elif name.startswith("ConvolutionBackward") or name.startswith("MkldnnConvolutionBackward"):
        w = saved.get("weight")
        if w:
            return 2 * out * prod(w[1:])
    elif name.startswith("ScaledDotProduct") or "AttentionBackward" in name:
        q, k = saved.get("query"), saved.get("key")
        if q and k and len(q) >= 2 and len(k) >= 2:
            return 4 * prod(q[:-1]) * k[-2] * q[-1]
    elif "RnnLayerBackward" in name or name.startswith("CudnnRnnBackward") or "LstmBackward" in name:
        x = saved.get("input")
        weights = sum(prod(s) for slot, s in saved.items() if slot.startswith("weight") and len(s) == 2)
        if x and len(x) >= 2 and weights:
            return 2 * prod(x[:-1]) * weights
    return out


def forward_flops(graph) -> dict[str, int]:
    """``{op node id: estimated forward FLOPs}`` for every op node of ``report.graph``."""
    return {n: node_flops(d) for n, d in graph.nodes(data=True) if d.get("kind") == "op"}
