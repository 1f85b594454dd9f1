"""``report.plan(budget=...)`` and ``report.max_batch(budget=...)``: make the step fit, predicted.

NOTE [the planner]
The price of checkpointing a module is the forward it runs again: its FLOPs, estimated from the graph's
shapes (``cost.py``; the trace records no clock). What it buys is the saved tensors it no longer keeps:
those of its calls that no node outside it also saves, minus the region inputs the checkpoint keeps
(``select.region_inputs``). A greedy pass ranks candidate modules by FLOPs per byte bought, cheapest
first, and adds them one at a time, skipping a module inside (or around) one already chosen and any that
does not lower the replayed peak (the peak is not a sum: the recompute of the largest region comes back
in backward); it stops as soon as the replayed peak fits, then drops, most expensive first, every chosen
module the plan fits without. A big parent buys more per FLOP on paper than its children (it keeps one
input, not one per child) yet recomputes everything at once, so the pass runs over all modules and once
per depth of the module tree (``blocks.*``, ``blocks.*.*``, ...); the fitting plan with the least
recompute wins. Every number reported is a replay of the changed step, never the estimate.

Offloading (``save_on_cpu``) recomputes nothing but saves memory only off the CPU (``whatif.py``); with
``offload="auto"`` it is used on an accelerator once checkpointing alone cannot fit, never on the CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gradscope._format import human_bytes, one_line
from gradscope.errors import InputValueError
from gradscope.graph.attribution import storage_uses
from gradscope.memory.planning.idiom import contiguous, hf_switch, loss_note, prefer_switch, switch_note
from gradscope.memory.planning.maxbatch import MaxBatch, max_batch
from gradscope.memory.planning.plancode import floor_bytes, not_fit, parse_budget, plan_code, span_names
from gradscope.memory.planning.select import module_regions, region_inputs, require_modules
from gradscope.memory.planning.whatif import WhatIf, context, in_forward_order, step_device, steps_line, what_if
from gradscope.memory.targets import resolve

__all__ = ["Plan", "MaxBatch", "plan", "max_batch", "parse_budget", "plan_code", "span_names"]


@dataclass
class Plan:
    """What to checkpoint / offload so that the step fits ``budget`` (see :func:`plan`).

    Attributes:
        checkpoint: modules to wrap in ``checkpoint(use_reentrant=False)``; offload: modules to run under
            ``save_on_cpu()``.
        peak: predicted absolute peak with the plan applied (the higher of step 1 and a later step: the
            steady state; ``result.first_step`` / ``result.later_step``); before: without it; fits:
            ``peak <= budget``.
        recompute_flops / forward_flops: the FLOPs the plan runs again and those of the forward
            (estimated from shapes); code: the lines to add; result: the plan's :class:`WhatIf`.
        floor: bytes no plan can remove (parameters, buffers, gradients, optimizer state);
        seconds: planning time; message: what is needed when nothing fits; notes: sentences in the
            user's idiom (a Hugging Face model's own switch, a peak at the loss: ``idiom.py``).
    """

    budget: int
    checkpoint: list[str]
    offload: list[str]
    peak: int
    before: int
    fits: bool
    recompute_flops: int = 0
    forward_flops: int = 0
    floor: int = 0
    code: str = ""
    result: WhatIf | None = None
    seconds: float = 0.0
    message: str = ""
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)

    @property
    def recompute_share(self) -> float:
        """Recomputed FLOPs as a share of the forward's (0.21: +21% forward work)."""
        return self.recompute_flops / self.forward_flops if self.forward_flops else 0.0

    def __str__(self) -> str:
        b = human_bytes
        head = (
            f"budget {b(self.budget)} on {self.device}: predicted peak {b(self.before)} "
            f"{'fits as is' if not (self.checkpoint or self.offload) and self.fits else ''}"
        ).rstrip()
        lines = [head]
        changed = bool(self.checkpoint or self.offload)
        res = self.result
        steps = "" if res is None else steps_line(res.memory, res.accumulate, res.set_to_none)
        if steps and not changed:
            lines.append("  " + steps)
        if self.checkpoint:
            lines.append(f"  checkpoint: {span_names(self.checkpoint)}")
        if self.offload:
            lines.append(f"  offload:    {span_names(self.offload)}")
        if self.checkpoint or self.offload:
            lines.append(
                f"  predicted peak {b(self.before)} -> {b(self.peak)} "
                f"({'fits' if self.fits else 'still over the budget'})"
            )
            if steps:
                lines.append("  with the plan: " + steps)
            lines.append(
                f"  recompute: +{self.recompute_share:.0%} forward FLOPs "
                f"({self.recompute_flops / 1e9:.3g} GFLOP, estimated from shapes)"
            )
        if self.message:
            lines.append("  " + self.message)
        lines += ["  " + note for note in self.notes]
        if self.code and self.fits:
            lines += ["", "Add after building the model:", *(("    " + ln).rstrip() for ln in self.code.splitlines())]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"<gradscope.Plan {'fits' if self.fits else 'does not fit'} {human_bytes(self.budget)}: "
            f"checkpoint {len(self.checkpoint)}, offload {len(self.offload)}, peak {human_bytes(self.peak)}>"
        )

    def render(self, report, path, **kwargs):
        """``report.render(path)`` with the planned modules' op nodes marked (``plan: checkpoint`` /
        ``plan: offload`` in the label, class ``gs-planned``); the marks are removed afterwards."""
        from gradscope.memory.planning.select import module_regions

        graph = report.graph
        marked = [
            (n, what)
            for what, names in (("checkpoint", self.checkpoint), ("offload", self.offload))
            for _, nodes in module_regions(graph, names)
            for n in nodes
        ]
        for n, what in marked:
            graph.nodes[n]["planned"] = what
        try:
            return report.render(path, **kwargs)
        finally:
            for n, _ in marked:
                graph.nodes[n].pop("planned", None)

    def to_svg(self, path=None, **kwargs) -> str:
        """Before/after backward curves and the budget line in one SVG: the SVG text, or with ``path`` the
        file written and its path (as ``render(path)``)."""
        from gradscope.memory.planning.planview import curves_svg
        from gradscope.svgchart import svg_or_path

        res = self.result
        assert res is not None  # plan() always sets the result
        curves = [("before", res.baseline)] + ([("with the plan", res.memory)] if res else [])
        return svg_or_path(curves_svg(curves, budget=self.budget, **kwargs), path)


def _candidates(report, names: list[str]) -> list[tuple[float, str, int, int]]:
    """``(FLOPs per byte, module, estimated bytes bought, FLOPs)`` of every module worth checkpointing."""
    from gradscope.memory.replay.holders import external_storages

    graph = report.graph
    ctx = context(report)
    order, flops = ctx["order"], ctx["flops"]
    uses = [u for u in storage_uses(graph, order) if u.category == "held"]
    external = external_storages(graph)
    out = []
    for name in names:
        regions = module_regions(graph, [name], order, ctx["regions"])
        inside = {n for _, nodes in regions for n in nodes}
        if not inside:
            continue
        keep = set()
        for _, nodes in regions:
            keep |= region_inputs(graph, nodes)[0]
        bought = sum(
            u.nbytes for u in uses if u.key not in keep and u.key not in external and all(n in inside for n in u.users)
        )
        cost = sum(flops.get(n, 0) for n in inside)
        if bought > 0:
            out.append((cost / bought, name, bought, cost))
    out.sort()
    return out


def _nested(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def plan(
    report,
    budget,
    optimizer=None,
    *,
    batch: float = 1.0,
    offload="auto",
    batch_size=None,
    margin: float = 0.02,
    target=None,
    accumulate: int = 1,
    set_to_none: bool = True,
) -> Plan:
    """The cheapest set of modules to checkpoint (and, off the CPU, offload) so that the step fits ``budget``.

    Args:
        report: a report inspected with ``trace=`` (module attribution is needed).
        budget: bytes, or a size such as ``"12GiB"`` / ``"16 GB"``.
        optimizer: the ``torch.optim.Optimizer`` whose ``step()`` ends the step.
        batch: plan for the batch scaled by this factor.
        offload: ``"auto"`` (only on an accelerator, after checkpointing), True or False.
        margin: the planner aims this share under the budget (the prediction's tolerance, 2%), so that
            the applied plan fits; ``fits`` still compares the predicted peak with the budget itself.
        target: the device: ``"cpu"`` (default), ``"cuda"`` (modelled, not measured) or a Target.
        accumulate / set_to_none: micro-steps per ``optimizer.step()`` and how ``zero_grad()`` clears
            ``.grad``; the plan fits the higher of step 1 and a later step (:func:`what_if`).

    Returns:
        A :class:`Plan`; ``plan.fits`` is False (with ``plan.message`` saying what is needed) when no plan
        fits. See NOTE [the planner].
    """
    t0 = time.perf_counter()
    dev = None if target is None else resolve(target)  # the name is reused below for the planner's aim
    limit = parse_budget(budget)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 0.5:
        raise InputValueError(f"margin= is a share of the budget in [0, 0.5), got {one_line(margin)}.")
    target = int(limit * (1 - margin))
    if offload not in ("auto", True, False):
        raise InputValueError(f"offload= takes 'auto', True or False, got {one_line(offload)}.")
    graph = report.graph
    names = require_modules(graph, "plan")
    device = step_device(graph) if dev is None else dev.name
    can_offload = device != "cpu" and offload is not False
    if dev is not None and not dev.measured:
        device = dev.label

    from gradscope.memory.replay.backward import Overrides, check_steps, replay

    accumulate = check_steps(accumulate, set_to_none)
    steps: dict[str, Any] = {"accumulate": accumulate, "set_to_none": set_to_none}
    unchanged = replay(report, Overrides(target=dev, **steps), optimizer=optimizer)

    memo: dict = {}

    def peak_of(ck, off):
        key = (frozenset(ck), frozenset(off))
        if key not in memo:
            memo[key] = what_if(report, ck, off, batch, optimizer, batch_size, baseline=unchanged, target=dev, **steps)
        return memo[key]

    base = peak_of([], [])
    floor = floor_bytes(report, base)
    chosen: list[str] = []
    off: list[str] = []
    best = base
    if base.peak > target and floor <= target:
        chosen, off, best = _search(_candidates(report, names), peak_of, base, target, can_offload)
    if chosen and best.peak <= target:  # NOTE in idiom.py: a range rather than a list with holes
        chosen, best = contiguous(chosen, off, best, peak_of, target, set(names))
        chosen, best = prefer_switch(graph, chosen, off, best, peak_of, target)
    fits = best.peak <= limit
    message = "" if fits else not_fit(best, limit, floor, bool(chosen or off))
    chosen, off = in_forward_order(report, chosen), in_forward_order(report, off)
    notes = [switch_note(graph, chosen, off, peak_of, limit, best.recompute_flops) if fits else None]
    notes.append(loss_note(graph, base.memory, base.peak - best.peak, fits))
    return Plan(
        budget=limit,
        checkpoint=chosen,
        offload=off,
        peak=best.peak,
        before=base.peak,
        fits=fits,
        recompute_flops=best.recompute_flops,
        forward_flops=best.forward_flops,
        floor=floor,
        code=(None if off else hf_switch(graph, chosen)) or plan_code(chosen, off),
        result=best,
        seconds=time.perf_counter() - t0,
        message=message,
        device=device,
        notes=[n for n in notes if n],
    )


def _search(cands, peak_of, base: WhatIf, target: int, can_offload: bool):
    """NOTE [the planner]'s passes (all modules, then one depth of the module tree at a time):
    ``(checkpoint, offload, WhatIf)`` of the fitting plan with the least recompute, else the lowest peak."""
    chosen: list[str] = []
    off: list[str] = []
    best = base
    runs = [cands] + [[c for c in cands if c[1].count(".") == d] for d in sorted({c[1].count(".") for c in cands})]
    results = []
    bound = None  # the least recompute of a fitting plan so far: a pass that spends more stops
    for run in runs:
        if run:
            results.append(_greedy(run, peak_of, base, target, can_offload, bound))
            if results[-1][2].peak <= target:
                cost = sum(c[3] for c in cands if c[1] in results[-1][0])
                bound = cost if bound is None else min(bound, cost)
    fitting = [r for r in results if r[2].peak <= target]
    if fitting:
        chosen, off, best = min(fitting, key=lambda r: (r[2].recompute_flops, r[2].peak))
    elif results:
        chosen, off, best = min(results, key=lambda r: (r[2].peak, r[2].recompute_flops))
    return chosen, off, best


def _greedy(cands, peak_of, base: WhatIf, target: int, can_offload: bool, bound=None):
    """One pass of NOTE [the planner] over ``cands``: ``(checkpoint, offload, WhatIf)``; the pass gives up
    once the chosen modules cost more than ``bound`` FLOPs (a cheaper fitting plan is known)."""
    chosen: list[str] = []
    off: list[str] = []
    best = base
    spent = 0
    for _, name, _, cost in cands:
        if any(_nested(name, c) for c in chosen):
            continue
        if bound is not None and spent + cost >= bound:
            continue
        trial = peak_of(chosen + [name], off)
        if trial.peak < best.peak:
            chosen.append(name)
            spent += cost
            best = trial
            if best.peak <= target:
                break
    if best.peak > target and can_offload:
        for _, name, _, _ in cands:
            if any(_nested(name, c) for c in chosen + off):
                continue
            trial = peak_of(chosen, off + [name])
            if trial.peak < best.peak:
                off.append(name)
                best = trial
                if best.peak <= target:
                    break
    if best.peak <= target:  # prune: most expensive first, keep a removal that still fits
        costs = {name: cost for _, name, _, cost in cands}
        for name in sorted(chosen, key=lambda n: -costs.get(n, 0)):
            trial = peak_of([c for c in chosen if c != name], off)
            if trial.peak <= target:
                chosen.remove(name)
                best = trial
    return chosen, off, best
