"""A change turned into the backward replay's terms, and what every what-if on a report shares.

``change_overrides`` turns checkpointed / offloaded module names and a batch factor into ``Overrides``
(sizes scaled with the batch, NOTE [what scales with the batch] in ``select.py``) plus the checkpoint
regions and offloaded nodes; ``replay_change`` replays the step with the program rewritten for them
(``rewrite.py``). ``context`` caches on the report what they all read: forward order, module calls,
FLOPs, the engine order's ranks, scalers. Used by :mod:`gradscope.memory.planning.whatif` and the planners.
"""

from __future__ import annotations

from collections import Counter

from gradscope.errors import InputValueError
from gradscope.graph import ROOT_SHAPES, ROOT_STORAGE_BYTES
from gradscope.graph.attribution import seq_order
from gradscope.memory.planning.select import Scaler, all_regions, module_regions

__all__ = [
    "context",
    "scaler_for",
    "in_forward_order",
    "step_device",
    "change_overrides",
    "replay_change",
    "loss_buffer",
]


_CONTEXT_KEY = "memory.planning.whatif.context"  # in report.cache


def context(report) -> dict:
    """What every what-if on ``report`` shares, computed once (cached on the report; the graph is not
    changed): forward order, module calls, FLOPs per node, the engine order's ranks, scalers."""
    cache = getattr(report, "cache", None)
    c = None if cache is None else cache.get(_CONTEXT_KEY)
    if c is None or c["graph"] is not report.graph:
        from gradscope.memory.planning.cost import forward_flops
        from gradscope.memory.replay.backward import program
        from gradscope.memory.replay.engine import engine_order

        graph = report.graph
        order = seq_order(graph)
        c = {
            "graph": graph,
            "order": order,
            "regions": all_regions(graph, order),
            "flops": forward_flops(graph),
            "scalers": {},
            "device": step_device(graph),
            "rank": {v: i for i, v in enumerate(engine_order(program(report)))},
        }
        if cache is not None:
            cache[_CONTEXT_KEY] = c
    return c


def scaler_for(report, batch_size) -> Scaler:
    """The batch scaler of ``report`` for the traced batch ``batch_size`` (None: guessed), built once."""
    scalers = context(report)["scalers"]
    if batch_size not in scalers:
        scalers[batch_size] = Scaler(report.graph, batch_size)
    return scalers[batch_size]


def in_forward_order(report, names: list[str]) -> list[str]:
    """``names`` sorted by their first call in the forward (``blocks.2`` before ``blocks.10``)."""
    ctx = context(report)
    first = ctx.get("first")
    if first is None:
        pos = {nid: i for i, nid in enumerate(ctx["order"])}
        first = ctx["first"] = {n: pos[runs[0][0]] for n, runs in ctx["regions"].items() if runs}
    return sorted(names, key=lambda n: (first.get(n, len(first)), n))


def step_device(graph) -> str:
    """The device most op nodes run on (``"cpu"`` when unknown)."""
    count = Counter(d.get("device") for _, d in graph.nodes(data=True) if d.get("kind") == "op" and d.get("device"))
    return count.most_common(1)[0][0] if count else "cpu"


def _scale(scaler: Scaler, graph, k: float):
    flat: set[tuple] = set()  # 1-D buffers (RNN workspace) that scale: NOTE [what scales with the batch]
    for _, d in graph.nodes(data=True):
        ones = [e["shape"] for e in d.get("saved") or () if e.get("shape") and len(e["shape"]) == 1]
        if ones:
            floor = scaler.flat_floor(d)
            flat.update(tuple(s) for s in ones if scaler.scales(s, floor))

    def scale(shape, dtype, nbytes):
        if scaler.scales(shape) or (len(shape) == 1 and tuple(shape) in flat):
            return int(round(nbytes * k))
        return nbytes

    return scale


def change_overrides(
    report,
    checkpoint=(),
    offload=(),
    batch: float = 1.0,
    scaler: Scaler | None = None,
    target=None,
    accumulate: int = 1,
    set_to_none: bool = True,
):
    """``(Overrides, notes, checkpoint regions, offloaded node ids)`` for checkpointed / offloaded module
    names (already resolved), predicted for device ``target`` (a Target or None), ``accumulate``
    micro-steps per optimizer step and ``zero_grad(set_to_none=...)`` (replay/steady.py NOTE [first and
    later steps])."""
    from gradscope.memory.replay.backward import Overrides

    graph = report.graph
    ctx = context(report)
    order = ctx["order"]
    regions = module_regions(graph, list(checkpoint), order, ctx["regions"])
    notes = []
    off_nodes: set = set()
    if offload:
        if (ctx["device"] if target is None else target.name) == "cpu":
            notes.append(
                "the step runs on the CPU, where save_on_cpu() keeps each saved tensor where it is "
                "(tensor.cpu() returns the tensor itself): offloading saves no memory"
            )
        else:
            off_nodes = {
                nid for _, nodes in module_regions(graph, list(offload), order, ctx["regions"]) for nid in nodes
            }
    scale = None
    if batch != 1:
        scaler = scaler or scaler_for(report, None)
        if scaler.batch_size is None:
            raise InputValueError(
                "what_if(batch=...) found no activation whose shape shows the batch size; "
                "pass batch_size= (the batch of the traced forward)."
            )
        scale = _scale(scaler, graph, batch)
    ov = Overrides(scale=scale, target=target, accumulate=accumulate, set_to_none=set_to_none)
    return ov, notes, regions, frozenset(off_nodes)  # rewrite.py: the last two


class _Rewritten:
    """The report as the replay sees it, with a rewritten program (``backward.program`` reads the cache)."""

    def __init__(self, report, prog):
        from gradscope.memory.replay.backward import PROGRAM_KEY

        self.graph = report.graph
        self.findings = report.findings
        self.cache = {PROGRAM_KEY: (report.graph, prog)}


def replay_change(report, ov, regions, off=frozenset(), optimizer=None, transform=None):
    """The replay of the step with ``change_overrides``' result applied; ``transform(program)`` rewrites
    the compiled program first (a dtype change: ``sharding/precision.py``)."""
    from gradscope.memory.planning.rewrite import with_checkpoints, with_offload
    from gradscope.memory.replay.backward import program, replay

    if regions or off or transform is not None:
        ctx = context(report)
        prog = program(report) if transform is None else transform(program(report))
        prog = with_checkpoints(prog, report.graph, regions, ctx["device"], ctx["rank"])
        report = _Rewritten(report, with_offload(prog, off))
    return replay(report, ov, optimizer=optimizer)


def loss_buffer(graph, k: float) -> int:
    """Bytes the loss's storage grows by with the batch scaled by ``k``: a scalar loss that views a bigger
    buffer (MSE's mean over the elementwise losses) keeps a buffer of the batch's size."""
    from gradscope.memory.replay.engine import numel_bytes

    if k == 1:
        return 0
    shapes, stored = graph.graph.get(ROOT_SHAPES, ()), graph.graph.get(ROOT_STORAGE_BYTES) or ()
    extra = sum(
        b - numel_bytes(s, "float32") for s, b in zip(shapes, stored) if b is not None and b > numel_bytes(s, "float32")
    )
    return int(round(extra * (k - 1)))
