"""``what_if(shard=...)``: the per-rank step under DDP or FSDP2, from the single-process replay.

The change (checkpoint, offload, batch) is applied as in :func:`what_if`; the sharding rules in
``memory/sharding/`` then turn the changed step's replay into one ``(low, high)`` peak per rank.
"""

from __future__ import annotations

from dataclasses import replace

from gradscope.errors import InputTypeError
from gradscope.memory.planning.select import Scaler
from gradscope.memory.planning.whatif import change_overrides, context, in_forward_order, replay_change, what_if
from gradscope.memory.sharding.ddp import ddp_step
from gradscope.memory.sharding.result import ShardedStep
from gradscope.memory.sharding.specs import DDP, FSDP

__all__ = ["sharded_what_if", "check_spec"]


def check_spec(shard) -> DDP | FSDP:
    """``shard`` when it is a spec, else one sentence saying what to pass."""
    if not isinstance(shard, (DDP, FSDP)):
        raise InputTypeError(
            f"shard= takes gradscope.DDP(world_size) or gradscope.FSDP(world_size, modules=[...]), got {shard!r:.60}."
        )
    return shard


def sharded_what_if(
    report, shard, checkpoint=None, offload=None, batch: float = 1.0, optimizer=None, batch_size=None, baseline=None
) -> ShardedStep:
    """The step with the change applied and sharded by ``shard`` (see :func:`gradscope.memory.sharding`)."""
    spec = check_spec(shard)
    wi = what_if(report, checkpoint, offload, batch, optimizer, batch_size, baseline)
    ov, _, regions, off_nodes = change_overrides(
        report, wi.checkpoint, wi.offload, wi.batch, Scaler(report.graph, wi.batch_size) if wi.batch != 1 else None
    )
    grown = 0
    if wi.batch != 1:  # what_if adds the loss buffer's growth to its replay; the runs below add it too
        grown = wi.peak - replay_change(report, ov, regions, off_nodes, optimizer).absolute_peak

    def run(has_grad=None, transform=None):
        if has_grad is None and transform is None:
            return wi.memory
        step_ov = ov if has_grad is None else replace(ov, has_grad=has_grad)
        mem = replay_change(report, step_ov, regions, off_nodes, optimizer, transform)
        mem.absolute_peak += grown
        return mem

    device = context(report)["device"]
    change = wi.change()
    if isinstance(spec, DDP):
        step = ddp_step(report.graph, spec, run, before=wi.before, single=wi.peak, change=change, device=device)
        step.checkpoint = list(wi.checkpoint)
        return step
    from gradscope.memory.sharding.fsdp import fsdp_step

    modules = in_forward_order(report, sorted({m for m in wi.memory.modules if m} | _all_modules(report)))
    step = fsdp_step(
        report.graph,
        spec,
        run(transform=_cast(report.graph, spec)),
        optimizer,
        modules=modules,
        before=wi.before,
        single=wi.peak,
        change=change,
        device=device,
    )
    step.checkpoint = list(wi.checkpoint)
    return step


def _cast(graph, spec: FSDP):
    """The replay's dtype change for ``spec.mp_policy`` (None without one): NOTE [FSDP2 mixed precision]."""
    if not spec.param_dtype:
        return None
    from gradscope.memory.sharding.precision import in_param_dtype, params_dtype

    orig = params_dtype(graph)
    if orig == spec.param_dtype:
        return None
    return lambda prog: in_param_dtype(prog, graph, spec.param_dtype, orig)


def _all_modules(report) -> set[str]:
    from gradscope.graph import CALLED_MODULES

    return set(report.graph.graph.get(CALLED_MODULES) or ())
