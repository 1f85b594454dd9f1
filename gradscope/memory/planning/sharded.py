"""``what_if(shard=...)``: the per-rank step under DDP or FSDP2, from the single-process replay.

The change (checkpoint, offload, batch) is applied as in :func:`what_if`; the sharding rules in
``memory/sharding/`` then turn the changed step's replay into one ``(low, high)`` peak per rank.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gradscope.errors import InputTypeError, InputValueError
from gradscope.memory.planning.select import Scaler
from gradscope.memory.planning.whatif import change_overrides, in_forward_order, replay_change, what_if
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
    report,
    shard,
    checkpoint=None,
    offload=None,
    batch: float = 1.0,
    optimizer=None,
    batch_size=None,
    baseline=None,
    target=None,
    accumulate: int = 1,
    set_to_none: bool = True,
) -> ShardedStep:
    """The step with the change applied and sharded by ``shard`` (see :func:`gradscope.memory.sharding`), on
    the device the graph was built on or ``target`` (``"cuda"``: the device's parts modelled, not measured);
    ``accumulate`` / ``set_to_none`` as in :func:`what_if` (DDP; FSDP2 models one backward per step with
    ``zero_grad()``'s default and says so for anything else)."""
    from gradscope.memory.targets import resolve as resolve_target

    spec = check_spec(shard)
    if isinstance(spec, FSDP) and (accumulate != 1 or set_to_none is not True):
        raise InputValueError(
            "what_if(shard=FSDP(...)) models one backward per optimizer step with zero_grad(set_to_none=True); "
            "accumulate= and set_to_none=False are modelled for DDP and one process only."
        )
    steps: dict[str, Any] = {"accumulate": accumulate, "set_to_none": set_to_none}
    wi = what_if(report, checkpoint, offload, batch, optimizer, batch_size, baseline, target, **steps)
    scaler = Scaler(report.graph, wi.batch_size) if wi.batch != 1 else None
    dev = None if target is None else resolve_target(target)
    ov, _, regions, off_nodes = change_overrides(
        report, wi.checkpoint, wi.offload, wi.batch, scaler, dev, wi.accumulate, set_to_none
    )
    grown = 0
    if wi.batch != 1:  # what_if adds the loss buffer's growth to its replay; the runs below add it too
        grown = wi.peak - replay_change(report, ov, regions, off_nodes, optimizer).absolute_peak

    def run(has_grad=None, transform=None):
        if has_grad is None and transform is None:
            return wi.memory
        step_ov = ov if has_grad is None else replace(ov, has_grad=has_grad)
        mem = replay_change(report, step_ov, regions, off_nodes, optimizer, transform)
        if grown:
            mem.absolute_peak += grown
            mem.first_step, mem.later_step = mem.first_step.grown(grown, "loss"), mem.later_step.grown(grown, "loss")
        return mem

    device = wi.device
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
