"""FSDP2's per-rank step: the single-process replay with FSDP2's unshard / reshard / reduce-scatter events.

NOTE [FSDP2 timeline]
Read from torch 2.13's ``torch/distributed/fsdp/_fully_shard`` and checked per rank against torch.profiler
on gloo (tests/memory/test_sharding.py). Each rank holds its padded shards (NOTE [FSDP2 layout]) and runs
the whole traced forward and backward on its own batch; around each group FSDP2 adds:

- **forward**, groups in forward order, the root first: the all-gather allocates the flat output (world x
  padded shard) and a buffer of the same size that gloo's copy frees at once (2 x output at its height);
  the copy-out allocates the unsharded parameters, then frees the *previous* group's all-gather output
  (FSDP2 keeps the last all-gather's result alive until the next one is copied out); after the group's
  forward its unsharded parameters are freed (``reshard_after_forward=True``), kept (False), or replaced by
  shards of a smaller mesh (an int). The root's are kept; the root's post-forward frees the last output.
- **backward**, groups in reverse forward order: the root's pre-backward (a hook on the model's outputs,
  so after the backward of the loss computed outside the model) prefetches the first group's all-gather;
  each group's pre-backward copies out its parameters, frees its own all-gather output and prefetches
  the next group's. After the group's last node its post-backward frees the unsharded parameters, frees
  the previous group's reduce-scatter input, allocates its own (world x padded shard), frees the unsharded
  gradients, allocates the sharded gradient and, on gloo, a temporary the size of the
  input. The root's post-backward runs in the callback at the end of backward, followed by the group whose
  post-backward hook never fired (the first block, when the model's input needs no gradient).
- **optimizer.step()** on the local shards (``optstep.py``).

The floor (``low``) frees everything as early as the program allows. The ceiling (``high``) adds what gloo
may still hold when a collective's work object is released by its worker thread: one reduce-scatter input
per group (seen: the per-rank peak of the same run moving in whole steps of one group).
"""

from __future__ import annotations

from dataclasses import dataclass

from gradscope.graph import MODULE_CALLS, PARAMS
from gradscope.graph.attribution import node_modules, seq_order, storage_uses
from gradscope.memory.sharding.layout import ROOT, Group, group_of, groups, shard_rows
from gradscope.memory.sharding.offload import host_parts, offload_notes
from gradscope.memory.sharding.optstep import sharded_step
from gradscope.memory.sharding.precision import params_dtype, precision_note
from gradscope.memory.sharding.result import ShardedStep
from gradscope.memory.sharding.specs import FSDP, dtype_bytes

__all__ = ["fsdp_step"]

#: Bytes per rank of the ``DeviceMesh``'s tensor of ranks (int32), which every FSDP2 rank keeps.
MESH_RANK_BYTES = 4


def _acts_before(graph, names: list[str], total: int) -> dict[str, int]:
    """Saved bytes alive when each group's forward starts (the single process's, in forward order, scaled
    so that the whole forward gives ``total``, the replay's batch-scaled count)."""
    order = seq_order(graph)
    mods = node_modules(graph)
    pos = {nid: i for i, nid in enumerate(order)}
    first: dict[str, int] = {}
    for nid in order:
        g = group_of(mods.get(nid) or "", names)
        first.setdefault(g, pos[nid])
    uses = [(pos.get(u.owner, 0), u.nbytes) for u in storage_uses(graph, order) if u.category == "held"]
    raw = sum(n for _, n in uses) or 1
    k = total / raw
    return {g: int(sum(n for p, n in uses if p < at) * k) for g, at in first.items()}


class _Peak:
    def __init__(self) -> None:
        self.value = 0
        self.where = ""

    def at(self, level: int, where: str) -> None:
        if level > self.value:
            self.value, self.where = level, where


@dataclass(frozen=True, slots=True)
class _Bytes:
    """One group's FSDP2 buffers, in the dtypes of the policy (NOTE [FSDP2 mixed precision])."""

    full: int  # the unsharded parameters (param_dtype)
    ag: int  # the all-gather output: world x the padded shards (param_dtype)
    flat: int  # the cast copy of the padded shards the all-gather sends (mixed precision only)
    small: int  # reshard_after_forward=int: the shards of the smaller mesh kept after forward (param_dtype)
    rs: int  # the reduce-scatter input: world x the padded shards (reduce_dtype)
    chunk: int  # the largest padded chunk of one gradient cast into the input (reduce_dtype != param_dtype)
    cast: int  # the reduce-scatter output cast to the parameters' dtype (reduce_dtype != their dtype)
    grads: int  # the unsharded gradients autograd makes (param_dtype)
    grad: int  # the sharded gradients: views into one flat padded output (the parameters' dtype)
    shard: int  # the padded shards in the parameters' dtype (CPU offload copies them to the device)


def _dtypes(spec: FSDP, orig: str) -> tuple[str, str]:
    """``(param dtype, reduce dtype)`` as FSDP2 settles them: a ``param_dtype`` equal to the parameters'
    is none, a ``reduce_dtype`` equal to ``param_dtype`` or None reduces in ``param_dtype``."""
    pd = spec.param_dtype or orig
    return pd, spec.reduce_dtype or pd


def _sizes(spec: FSDP, g: Group, grads: int, chunks: dict, orig: str) -> _Bytes:
    world = spec.world_size
    ob = g.padded // g.numel_padded if g.numel_padded else dtype_bytes(orig, 4)
    pd, rd = _dtypes(spec, orig)
    pb, rb = dtype_bytes(pd, ob), dtype_bytes(rd, ob)
    shard = g.numel_padded * pb
    return _Bytes(
        full=g.numel_full * pb,
        ag=world * shard,
        flat=shard if pd != orig else 0,
        small=shard * world // spec.reshard_size,
        rs=world * g.numel_padded * rb,
        chunk=max((chunks[p] for p in g.params), default=0) * rb if rd != pd else 0,
        cast=g.numel_padded * rb if rd != orig else 0,
        grads=grads * pb // ob,
        grad=g.padded,
        shard=g.padded,
    )


def _chunks(graph, world: int) -> dict[str, int]:
    """Elements of each parameter's padded chunk (``ceil(d0 / world)`` rows)."""
    out = {}
    for name, p in graph.graph.get(PARAMS, {}).items():
        shape = [int(s) for s in p.get("shape") or []]
        rest = 1
        for s in shape[1:]:
            rest *= s
        out[name] = shard_rows(shape[0], world, 0) * rest if shape else 1
    return out


def _forward(spec: FSDP, by: dict[str, _Bytes], order: list[str], acts: dict, base: int, peak: _Peak, apart) -> int:
    """The forward's events from ``base``; returns what the unsharded parameters kept for backward add.
    ``apart``: the shards live on the host (CPU offload with an accelerator), copied to the device first."""
    root = by[ROOT]
    if apart:
        peak.at(base + root.shard + root.ag, "forward (all-gather of the root)")
    peak.at(base + root.flat + 2 * root.ag, "forward (all-gather of the root)")
    peak.at(base + root.ag + root.full, "forward (all-gather of the root)")
    level, prev, kept = base + root.full + root.ag, root.ag, root.full
    for name in order:
        g = by[name]
        here = level + acts.get(name, 0)
        if apart:  # the shards' copies to the device, then the flat output
            peak.at(here + g.shard + g.ag, f"forward (all-gather of {name})")
        peak.at(here + g.flat + 2 * g.ag, f"forward (all-gather of {name})")
        peak.at(here + g.ag + g.full, f"forward (all-gather of {name})")
        level += g.ag - prev
        prev = g.ag
        nxt = acts.get(_next(order, name), acts.get("$end", 0))
        peak.at(level + nxt + g.full, f"forward of {name}")
        if spec.reshard_after_forward is False:
            level += g.full
            kept += g.full
        elif spec.reshard_after_forward is not True:
            level += g.small
            kept += g.small
    return kept


def _next(order: list[str], name: str) -> str:
    i = order.index(name)
    return order[i + 1] if i + 1 < len(order) else "$end"


def _model_start(graph, bm) -> int:
    """Index in ``bm.order`` of the first node the model's forward made: the loss's nodes (made after the
    model returned, NOTE [module calls]) run before FSDP2's root pre-backward, which hooks the model's
    outputs. 0 when untraced."""
    end = next((c[4] for c in graph.graph.get(MODULE_CALLS) or () if c[0] is None and c[1] == -1), None)
    if end is None:
        return 0
    nodes = graph.nodes
    for i, nid in enumerate(bm.order):
        seq = nodes[nid].get("seq") if nid in nodes else None
        if seq is not None and seq < end:
            return i
    return 0


def _node_groups(graph, bm, names: list[str]) -> list[str | None]:
    """The group of each node of ``bm.order``; None for a parameter's or input's AccumulateGrad."""
    nodes = graph.nodes
    out: list[str | None] = []
    for nid, mod in zip(bm.order, bm.modules):
        kind = nodes[nid].get("kind") if nid in nodes else None
        out.append(None if kind in ("param", "input") else group_of(mod or "", names))
    return out


def _grad_bytes(graph, gs: list[Group]) -> dict[str, int]:
    """Unsharded gradient bytes each group's backward makes (parameters the graph reaches)."""
    params = graph.graph.get(PARAMS, {})
    out = {}
    for g in gs:
        out[g.name] = sum(g.bytes_of(p) for p in g.params if params[p].get("node") and params[p].get("requires_grad"))
    return out


def _backward(spec: FSDP, by: dict[str, _Bytes], order: list[str], bm, node_group, base: int, peak, apart, start=0):
    """The backward's events over the replayed levels from ``base``; returns the level after backward.
    ``apart``: each sharded gradient is copied to the host and freed on the device (CPU offload);
    ``start``: the first node of the model's own backward (:func:`_model_start`)."""
    back = list(reversed(order))
    gather = spec.reshard_after_forward is not False
    fs = 0  # what FSDP adds to (or removes from) the single process's level
    started: set[str] = set()
    rs_prev = 0
    last = {g: i for i, g in enumerate(node_group) if g}
    final = node_group[max(last.values())] if last else ROOT

    def prefetch(after: str | None) -> None:
        nonlocal fs
        nxt = back[back.index(after) + 1] if after in back and back.index(after) + 1 < len(back) else None
        if after is None and back:
            nxt = back[0]
        if nxt is None or not gather:
            return
        g = by[nxt]
        if apart and spec.reshard_after_forward is True:  # resharded to the host: copied to the device first
            peak.at(base + level + fs + g.shard + g.ag, f"backward (all-gather of {nxt})")
        flat = g.flat if spec.reshard_after_forward is True else g.flat and g.small
        peak.at(base + level + fs + flat + 2 * g.ag, f"backward (all-gather of {nxt})")
        fs += g.ag

    def post(name: str) -> None:
        nonlocal fs, rs_prev
        g = by[name]
        fs -= g.full  # the unsharded parameters (kept from forward too) go
        fs -= rs_prev
        fs += g.rs
        where = f"backward (reduce-scatter of {name or 'the root'})"
        peak.at(base + level + fs + g.chunk, where)
        fs += g.grad - g.grads  # the sharded gradients are views into one flat output (padded)
        peak.at(base + level + fs + max(g.rs, g.cast), where)
        if apart:  # the sharded gradient's copy to the host; the device's output goes
            fs -= g.grad
        rs_prev = g.rs

    level = 0
    posted: set[str] = set()
    for i, (g, lv, inner) in enumerate(zip(node_group, bm.levels, bm.inner or bm.levels)):
        if i == start:  # the root's pre-backward: on the gradient of the model's output
            prefetch(None)
        if g is not None:  # a group's post-backward runs once its last node and its AccumulateGrads are done
            for done in [d for d in started if d not in posted and last[d] < i and d != final]:
                posted.add(done)
                post(done)
        if g and g != ROOT and g not in started:
            started.add(g)
            if gather:
                fs += by[g].full
                peak.at(base + level + fs, f"backward (copy-out of {g})")
                fs -= by[g].ag
                if spec.reshard_after_forward is not True:
                    fs -= by[g].small
            prefetch(g)
        level = lv
        peak.at(base + max(lv, inner) + fs, f"backward of {g or 'the root'}")
    for done in [d for d in back if d in started and d not in posted and d != final]:
        post(done)
    post(ROOT)
    if final != ROOT:
        post(final)
    fs -= rs_prev
    return base + bm.end + fs  # the level after backward: the loss's seed gradient freed


def fsdp_step(
    graph, spec: FSDP, bm, optimizer, *, modules: list[str], before: int, single: int, change: str, device: str
) -> ShardedStep:
    """The per-rank step under ``spec`` from the single-process replay ``bm`` of the (changed) step;
    ``modules``: the traced model's module names in forward order."""
    world = spec.world_size
    gs = groups(graph, modules, spec.modules, world)
    names = [g.name for g in gs if g.name]
    parts = bm.parts
    acts_total = parts.get("saved activations and inputs", 0) + parts.get("loss", 0)
    acts = _acts_before(graph, names, parts.get("saved activations and inputs", 0))
    acts["$end"] = acts_total
    node_group = _node_groups(graph, bm, names)
    start = _model_start(graph, bm)
    grads = _grad_bytes(graph, gs)
    orig = params_dtype(graph)
    chunks = _chunks(graph, world)
    by = {g.name: _sizes(spec, g, grads[g.name], chunks, orig) for g in gs}
    sharded = sum(g.padded for g in gs)
    ceiling = sum(by[g.name].rs for g in gs if g.name) if device == "cpu" else 0
    apart = spec.offload and device != "cpu"  # NOTE [FSDP2 CPU offload] in offload.py
    held = parts.get("buffers", 0) + parts.get("leaf inputs", 0) + parts.get("batch", 0)
    if device == "cpu":  # the rank's DeviceMesh: its ranks as one int32 tensor, kept (on the host)
        held += MESH_RANK_BYTES * world
    ranks, all_parts, phase, host, later, first = [], [], [], [], [], []

    def run(step, state: int) -> _Peak:
        base = held + (0 if apart else sharded + state)
        peak = _Peak()
        kept = _forward(spec, by, names, acts, base, peak, apart)
        end = _backward(spec, by, names, bm, node_group, base + kept + acts_total, peak, apart, start)
        if step is not None and not apart:
            peak.at(end + step.peak, f"{step.name}.step()")
        return peak

    for rank in range(world):  # ranks: the higher of step 1 (as inspected) and the later steps
        step = sharded_step(optimizer, graph, world, rank)
        state = at_start = step.state_before if step is not None else 0
        peak = run(step, state)  # the step as inspected: the first (replay/steady.py NOTE [first and later steps])
        first.append((peak.value, peak.value + ceiling))
        if step is not None:  # later steps: the state the first one creates, alive from their start
            again = run(sharded_step(optimizer, graph, world, rank, later=True), state + step.state_new)
            later.append((again.value, again.value + ceiling))
            peak, at_start = (again, state + step.state_new) if again.value > peak.value else (peak, state)
        low = peak.value
        ranks.append((low, low + ceiling))
        p = {"buffers and inputs": held}
        if not apart:
            p |= {"sharded parameters (padded)": sharded, "optimizer state (before the step)": at_start}
        p["working set at the peak"] = low - sum(p.values())
        all_parts.append(p)
        phase.append(peak.where)
        if spec.offload:
            host.append(host_parts(gs, grads, rank if apart else None, state, step))
    notes = [
        f"each of the {world} ranks runs the traced batch; groups: the root and {len(names)} fully_shard "
        f"module(s) ({names[0]}{', ...' if len(names) > 1 else ''})",
    ]
    if spec.param_dtype and spec.param_dtype != orig:
        notes.append(precision_note(graph, spec.param_dtype, orig))
    if ceiling:
        notes.append(
            "high adds one reduce-scatter input per group: gloo's worker thread may release a collective's "
            "buffers after the step has moved on"
        )
    else:
        notes.append("NCCL's buffers and the streams holding blocks on the device: modelled, not measured")
    notes += offload_notes(spec, device)
    return ShardedStep(
        spec,
        ranks,
        all_parts,
        before,
        single,
        change,
        device,
        notes,
        phase,
        groups=names,
        host_parts=host,
        later=later,
        first=first,
    )
