"""A non-reentrant checkpoint region's recompute, op by op: its highest point, temporaries included.

NOTE [recompute step by step]
At a region's first unpack in backward, ``torch.utils.checkpoint`` re-runs the region's forward under
its own pack hook and stops (``_StopRecomputationError``) as soon as the last tensor the forward saved
has been packed again (docs/internals.md#non-reentrant-checkpoint). Until then each op allocates its
outputs: a tensor some node saved (``regions.py``'s recomputed keys) stays, and any other output is a
temporary that dies after the last op of the region that reads it (a view op's output is its input's
storage). The graph shows every op of the region that made a node: the nodes whose sequence numbers lie
between the region's first and last saving node, in that order, each with its output sizes. An op saves
its inputs before it runs and its outputs after: when the last pack is an input, the recompute stops
before that op allocates anything. What is not seen: ops of the region before its first saving node
that save nothing, ops without a node (under ``no_grad``, integer ops), an in-place op's output (counted
as a new tensor: the prediction is then high, never low), and kernel workspace inside a forward op.
With ``preserve_rng_state=True`` the recompute runs inside ``torch.random.fork_rng``, which copies the
RNG state (as many bytes as the frame keeps, ``("f", region)``) for as long as the forward re-runs.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from gradscope.memory.replay.engine import Program
from gradscope.memory.replay.gradients import STRIDE_VIEWS

__all__ = ["recompute_high"]

#: Forward ops whose output is a view of their first input (same storage).
_FORWARD_VIEWS = STRIDE_VIEWS | {
    "ViewBackward0",
    "UnsafeViewBackward0",
    "ReshapeAliasBackward0",
    "ExpandBackward0",
    "SliceBackward0",
    "SelectBackward0",
    "NarrowBackward0",
    "SplitBackward0",
    "SplitWithSizesBackward0",
    "UnbindBackward0",
    "AsStridedBackward0",
    "UnfoldBackward0",
    "DiagonalBackward0",
    "ViewAsRealBackward0",
    "ViewAsComplexBackward0",
    "CopySlices",
}


def recompute_high(prog: Program, rkey, sizes: dict, grad_scale) -> int | None:
    """The highest bytes the recompute of recorded region ``rkey`` holds at once (its recomputed tensors
    and its temporaries, NOTE [recompute step by step]); None for a region written by what-if planning."""
    if type(rkey) is not tuple or rkey[:1] != ("ck",):
        return None
    cache = prog.__dict__.setdefault("_recompute_highs", {})
    if grad_scale is None and sizes is prog.storages and rkey in cache:
        return cache[rkey]
    high = _high(prog, rkey, sizes, grad_scale)
    if grad_scale is None and sizes is prog.storages:
        cache[rkey] = high
    return high


def _forward_order(prog: Program) -> tuple[list, list]:
    """``(seqs, nodes)``: the op nodes sorted by sequence number (cached on the program)."""
    got = prog.__dict__.get("_by_seq")
    if got is None:
        pairs = sorted((s, i) for i, (s, lf) in enumerate(zip(prog.seq, prog.leaf)) if not lf)
        got = prog.__dict__["_by_seq"] = ([s for s, _ in pairs], [i for _, i in pairs])
    return got


def _high(prog: Program, rkey, sizes: dict, grad_scale) -> int:
    members = prog.regions.get(rkey) or ()
    fresh: dict[tuple, int] = dict(prog.recompute.get(next(iter(members)), ())) if members else {}
    if not fresh:
        return 0
    seqs, by_seq = _forward_order(prog)
    lo, hi = min(prog.seq[v] for v in members), max(prog.seq[v] for v in members)
    order = by_seq[bisect_left(seqs, lo) : bisect_right(seqs, hi)]
    inside = set(order)
    gbytes, edges = prog.grad_bytes, prog.edges
    key_of: dict = {}  # (node, output) -> the storage key its output lives in
    for key in fresh:
        src = key[2] if len(key) > 2 else None
        if type(src) is tuple and len(src) == 2 and type(src[1]) is int and src[0] in prog.index:
            key_of[(prog.index[src[0]], src[1])] = key
    made = {key for (u, _), key in key_of.items() if u in inside}
    cur = 0
    for key, nbytes in fresh.items():  # not made by an op of the region: counted from the start
        if key not in made:
            cur += sizes.get(key, nbytes)
    cur += prog.storages.get(("f", rkey), 0)  # fork_rng's copy of the RNG state, held while the forward re-runs
    base: dict = {}  # (node, output) of a view op -> the (node, output) whose storage it views
    for v in order:
        if prog.name[v] in _FORWARD_VIEWS and edges[v]:
            u = edges[v][0]
            for k in range(len(gbytes[v])):
                if (v, k) not in key_of:
                    base[(v, k)] = base.get(u, u) if u[0] in inside else None
    last_use: dict = {}
    for pos, v in enumerate(order):
        for u in edges[v]:
            u = base.get(u, u)
            if u is not None and u[0] in inside:
                last_use[u] = pos
    last = order[-1]
    stops_before = not any(u == last for u, _ in key_of)  # its last pack is an input: saved before it runs
    live: dict = {}
    high = cur
    for pos, v in enumerate(order):
        if v == last and stops_before:
            break
        for k, nbytes in enumerate(gbytes[v]):
            made_key = key_of.get((v, k))
            if made_key is not None:
                cur += sizes.get(made_key, fresh[made_key])
            elif (v, k) not in base:  # a view's output is its input's storage, kept by that one's uses
                nb = grad_scale(v, k, nbytes) if grad_scale is not None else nbytes
                live[(v, k)] = nb
                cur += nb
        high = max(high, cur)
        if v == last:
            break
        for out in [o for o in live if last_use.get(o, -1) == pos]:
            cur -= live.pop(out)
    return high
