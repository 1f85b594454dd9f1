"""DDP's per-rank step: the single-process step plus the gradient buckets.

NOTE [DDP memory]
``DistributedDataParallel`` allocates its gradient buckets when it is built (one flat tensor per bucket,
``bucket_cap_mb`` each, together the size of every parameter that requires a gradient) and keeps them. Each
rank runs the whole model on its own batch, so everything else is the single-process step. By default
backward's gradients are copied into the buckets, all-reduced and copied back: the buckets are a second
gradient-sized copy alive for the whole step. With ``gradient_as_bucket_view=True`` each ``.grad`` becomes
a view into its bucket: the gradient autograd makes is copied into the bucket and freed at once, as when
``.grad`` is already set, so the step is replayed with every ``.grad`` set and the buckets are those
gradients. Measured per rank on gloo (tests/memory/test_sharding.py): equal to this within 0.1%.
"""

from __future__ import annotations

from collections.abc import Callable

from gradscope.graph import PARAMS
from gradscope.memory.replay.engine import numel_bytes
from gradscope.memory.sharding.result import ShardedStep
from gradscope.memory.sharding.specs import DDP

__all__ = ["bucket_bytes", "ddp_step"]

BUCKETS = "DDP gradient buckets"


def bucket_bytes(graph) -> int:
    """Bytes of DDP's buckets: every parameter that requires a gradient (a shared storage once)."""
    seen, total = set(), 0
    for p in graph.graph.get(PARAMS, {}).values():
        if not p.get("requires_grad", True):
            continue
        sid = p.get("storage")
        if sid is not None:
            if sid in seen:
                continue
            seen.add(sid)
        total += numel_bytes(p.get("shape"), p.get("dtype"))
    return total


def ddp_step(graph, spec: DDP, run: Callable, *, before: int, single: int, change: str, device: str) -> ShardedStep:
    """The per-rank step under ``spec``; ``run(has_grad)`` replays the (changed) single-process step with
    ``.grad`` set for the named parameters (None: as traced)."""
    buckets = bucket_bytes(graph)
    if spec.gradient_as_bucket_view:
        names = [n for n, p in graph.graph.get(PARAMS, {}).items() if p.get("requires_grad", True)]
        mem = run(dict.fromkeys(names, True))
        parts = dict(mem.parts)
        grads = parts.pop("gradients", 0)
        parts[BUCKETS + " (the .grads)"] = max(grads, buckets)
        extra = max(0, buckets - grads)
    else:
        mem = run(None)
        parts = dict(mem.parts)
        parts[BUCKETS] = buckets
        extra = buckets
    low = mem.absolute_peak + extra  # the higher of step 1 and a later step (the buckets alive in both)
    first, later = mem.first_step.absolute_peak + extra, mem.later_step.absolute_peak + extra
    parts["backward and step (at the peak)"] = low - sum(parts.values())
    notes = [f"each of the {spec.world_size} ranks runs the traced batch (the per-rank batch)"]
    if device != "cpu":
        notes.append(
            "the collective backend's own buffers (NCCL allocates outside PyTorch's allocator) are not counted: "
            "modelled, not measured"
        )
    n = spec.world_size
    step = ShardedStep(spec, [(low, low)] * n, [parts] * n, before, single, change, device, notes, ["step"] * n)
    step.first, step.later = [(first, first)] * n, [(later, later)] * n
    return step
