"""``report.what_if(checkpoint=..., offload=..., batch=k)``: the step's memory with a change applied, predicted.

Nothing runs: the change is turned into overrides of the backward replay (``backward.py``'s internal API)
and the replay is run twice, on the unchanged and on the changed step.

- ``checkpoint``: each call of each named module becomes a region of
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (NOTE [module calls from sequence
  numbers] in ``select.py``): its saved tensors leave the forward's memory, except its inputs, which the
  checkpoint keeps, and come back when backward reaches the region (the recompute).
- ``offload``: the named modules' saved tensors are packed by ``torch.autograd.graph.save_on_cpu()``.
  On an accelerator they leave its memory until backward; on the CPU ``save_on_cpu`` keeps each tensor
  where it is (``tensor.cpu()`` returns the tensor itself), so offloading saves nothing there and the
  prediction says so (and is unchanged: the profiler measures the same step).
- ``batch=k``: every tensor whose shape holds the batch grows by ``k`` (NOTE [what scales with the batch]
  in ``select.py``); parameters, gradients, optimizer state and shape-only tensors stay.

The peak compared with a budget is the steady state's: the higher of step 1 and a later step (the
optimizer's state alive from its start; ``accumulate`` micro-steps per optimizer step; ``.grad`` as
``zero_grad(set_to_none=...)`` leaves it): replay/steady.py NOTE [first and later steps]. Both steps
are on the result (``first_step``, ``later_step``) and printed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gradscope._format import human_bytes, one_line, shape_str
from gradscope.errors import InputTypeError, InputValueError
from gradscope.graph.attribution import storage_uses
from gradscope.memory.planning.change import (
    change_overrides,
    context,
    in_forward_order,
    loss_buffer,
    replay_change,
    scaler_for,
    step_device,
)
from gradscope.memory.planning.select import Scaler, require_modules, resolve

if TYPE_CHECKING:
    from gradscope.memory.replay.backward import BackwardMemory
    from gradscope.memory.replay.steady import StepPeak

__all__ = ["WhatIf", "what_if", "step_device", "change_overrides", "replay_change", "in_forward_order"]


@dataclass
class WhatIf:
    """The predicted step with a change applied (see :func:`what_if`).

    Attributes:
        peak: predicted absolute peak of the changed step (bytes): parameters, buffers, inputs, ``.grad``s,
            optimizer state, activations and backward's transient peak, up to the end of
            ``optimizer.step()`` when an optimizer was given, else of backward; the higher of step 1 and a
            later step (``first_step``, ``later_step``: the steady state).
        before: the same for the unchanged step (``backward_memory(optimizer=...).absolute_peak``).
        accumulate: micro-steps (backward passes) per optimizer step; set_to_none: how ``zero_grad()``
            clears ``.grad`` between steps (False: kept as zeros).
        checkpoint / offload: the modules the change wraps (patterns resolved to outermost modules).
        batch: the batch factor ``k``; ``batch_size`` the traced batch size it multiplies.
        memory: the changed step's replay (``.order``, ``.levels``: the backward curve), ``baseline`` the
            unchanged one.
        recompute_flops: forward FLOPs the checkpointed regions run again (estimated from shapes, see
            ``cost.py``); ``forward_flops`` those of the whole traced forward.
        scaled / fixed: saved-activation bytes that scale with the batch and that do not (traced batch).
        device: the device the step runs on; notes: sentences about the change (offloading on the CPU...).
    """

    peak: int
    before: int
    checkpoint: list[str]
    offload: list[str]
    batch: float
    batch_size: int | None
    memory: BackwardMemory
    baseline: BackwardMemory
    recompute_flops: int = 0
    forward_flops: int = 0
    scaled: int = 0
    fixed: int = 0
    fixed_examples: list[str] = field(default_factory=list)
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)
    accumulate: int = 1
    set_to_none: bool = True

    @property
    def first_step(self) -> StepPeak:
        """The changed step as inspected (step 1 of the loop): its absolute peak and parts."""
        return self.memory.first_step

    @property
    def later_step(self) -> StepPeak:
        """Every step after the first (the optimizer's state alive from its start)."""
        return self.memory.later_step

    @property
    def step(self) -> str:
        """Which step ``peak`` is for: ``"later steps"`` or ``"first step"`` (the higher; later on a tie)."""
        return _higher(self.memory)

    @property
    def saved(self) -> int:
        """Bytes the change saves on the peak (negative when it costs memory)."""
        return self.before - self.peak

    @property
    def recompute_share(self) -> float:
        """Recomputed FLOPs as a share of the forward's (0.21 = +21% forward work)."""
        return self.recompute_flops / self.forward_flops if self.forward_flops else 0.0

    def change(self) -> str:
        parts = []
        from gradscope.memory.planning.plancode import span_names

        if self.checkpoint:
            parts.append("checkpoint " + span_names(self.checkpoint))
        if self.offload:
            parts.append("offload " + span_names(self.offload))
        if self.batch != 1:
            parts.append(
                f"batch x{self.batch:g}"
                + (f" ({self.batch_size} -> {round(self.batch_size * self.batch)})" if self.batch_size else "")
            )
        return "; ".join(parts) or "no change"

    def __str__(self) -> str:
        lines = [
            f"what if: {self.change()}",
            f"  peak {human_bytes(self.before)} -> {human_bytes(self.peak)} "
            f"({'-' if self.saved >= 0 else '+'}{human_bytes(abs(self.saved))}) on {self.device}",
            "  " + steps_line(self.memory, self.accumulate, self.set_to_none),
        ]
        if self.checkpoint:
            lines.append(
                f"  recompute: {self.recompute_flops / 1e9:.3g} GFLOP, +{self.recompute_share:.0%} of the "
                "forward's FLOPs (estimated from shapes)"
            )
        if self.batch != 1:
            fixed = f"; fixed: {', '.join(self.fixed_examples)}" if self.fixed_examples else ""
            lines.append(
                f"  with the batch: {human_bytes(self.scaled)} of saved activations scale; "
                f"{human_bytes(self.fixed)} do not, nor parameters, gradients, optimizer state{fixed}"
            )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<gradscope.WhatIf {self.change()}: peak {human_bytes(self.peak)} (was {human_bytes(self.before)})>"

    def to_svg(self, path=None, **kwargs) -> str:
        """Before/after backward curves in one SVG (see :func:`gradscope.memory.planview.curves_svg`): the
        SVG text, or with ``path`` the file written and its path (as ``render(path)``)."""
        from gradscope.memory.planning.planview import curves_svg
        from gradscope.svgchart import svg_or_path

        return svg_or_path(curves_svg([("before", self.baseline), (self.change(), self.memory)], **kwargs), path)


def _higher(bm) -> str:
    return "first step" if bm.first_step.absolute_peak > bm.later_step.absolute_peak else "later steps"


def steps_line(bm, accumulate: int = 1, set_to_none: bool = True) -> str:
    """One line saying which step a peak is for: ``step 1 X, later steps Y: the peak is ...``."""
    k = f", {accumulate} micro-steps per optimizer step" if accumulate > 1 else ""
    z = ", zero_grad(set_to_none=False)" if not set_to_none else ""
    first, later = bm.first_step.absolute_peak, bm.later_step.absolute_peak
    whose = "step 1's" if _higher(bm) == "first step" else "the later steps'"
    return f"step 1 {human_bytes(first)}, later steps {human_bytes(later)}{k}{z}: the peak is {whose}"


def _batch_factor(batch) -> float:
    if isinstance(batch, bool) or not isinstance(batch, (int, float)):
        raise InputTypeError(f"batch= takes a number (the factor the batch is scaled by), got {one_line(batch)}.")
    if not batch > 0 or batch != batch or batch == float("inf"):
        raise InputValueError(f"batch= must be a positive finite factor (2 doubles the batch), got {one_line(batch)}.")
    return float(batch)


def _overlap(ck: list[str], off: list[str]) -> None:
    for a in ck:
        for b in off:
            if a == b or a.startswith(b + ".") or b.startswith(a + "."):
                raise InputValueError(
                    f"{a!r} is both checkpointed and offloaded (or one is inside the other, {b!r}); a module's "
                    "saved tensors are either recomputed or offloaded: name each module in one list."
                )


def _batch_split(scaler: Scaler, graph) -> tuple[int, int, list[str]]:
    scaled = fixed = 0
    examples: Counter = Counter()
    for use in storage_uses(graph):
        if use.category != "held":
            continue
        d = graph.nodes[use.owner]
        e = next((e for e in d["saved"] if ("s", e.get("storage")) == use.key), None)
        shape = e.get("shape") if e else None
        if scaler.scales(shape, scaler.flat_floor(d)):
            scaled += use.nbytes
        else:
            fixed += use.nbytes
            if e and shape and use.nbytes:  # shape is set only when e is
                examples[f"{shape_str(shape)} {e.get('dtype')} ({d.get('name')})"] += use.nbytes
    return scaled, fixed, [k for k, _ in examples.most_common(3)]


def what_if(
    report,
    checkpoint=None,
    offload=None,
    batch: float = 1.0,
    optimizer=None,
    batch_size: int | None = None,
    baseline=None,
    target=None,
    accumulate: int = 1,
    set_to_none: bool = True,
) -> WhatIf:
    """Predict the step's memory with modules checkpointed, offloaded, or the batch scaled by ``batch``.

    Args:
        report: a :class:`gradscope.Report` inspected with ``trace=`` (module attribution is needed).
        checkpoint: qualified module names or fnmatch patterns (``"blocks.*"``) to wrap in
            ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``; a pattern that matches a module
            and its children keeps the outermost.
        offload: module names or patterns whose saved tensors go under ``torch.autograd.graph.save_on_cpu()``.
        batch: factor the batch is scaled by (2 doubles it).
        optimizer: a ``torch.optim.Optimizer``: the peak then runs to the end of ``optimizer.step()``.
        batch_size: the traced forward's batch size, when the guess from the shapes is wrong.
        baseline: the unchanged step's replay when the caller has it (the planner), else replayed here.
        target: the device: ``"cpu"`` (default), ``"cuda"`` (modelled, not measured) or a Target.
        accumulate: backward passes per ``optimizer.step()`` (gradient accumulation).
        set_to_none: how ``zero_grad()`` clears ``.grad`` between steps (False: kept as zeros).

    Raises:
        InputValueError: the report was not traced, a pattern matches no module, a module is in both lists.
        InputTypeError: an argument of the wrong type.
    """
    from gradscope.memory.replay.backward import Overrides, check_steps, replay
    from gradscope.memory.targets import resolve as resolve_target

    accumulate = check_steps(accumulate, set_to_none)
    dev = None if target is None else resolve_target(target)
    graph = report.graph
    names = require_modules(graph, "what_if")
    ck = in_forward_order(report, resolve(graph, checkpoint, "checkpoint", names))
    off = in_forward_order(report, resolve(graph, offload, "offload", names))
    _overlap(ck, off)
    k = _batch_factor(batch)
    scaler = scaler_for(report, batch_size)
    ov, notes, regions, off_nodes = change_overrides(report, ck, off, k, scaler, dev, accumulate, set_to_none)
    plain = dev is None and accumulate == 1 and set_to_none
    unchanged = None if plain else Overrides(target=dev, accumulate=accumulate, set_to_none=set_to_none)
    before = baseline if baseline is not None else replay(report, unchanged, optimizer=optimizer)
    after = replay_change(report, ov, regions, off_nodes, optimizer)
    grown = loss_buffer(graph, k)
    if grown:  # a scalar loss viewing its elementwise buffer (MSE): the buffer has the batch's shape
        after.base += grown
        after.absolute_peak += grown
        after.parts["loss"] = after.parts.get("loss", 0) + grown
        after.first_step = after.first_step.grown(grown, "loss")
        after.later_step = after.later_step.grown(grown, "loss")
    flops = context(report)["flops"]
    recompute = sum(flops.get(n, 0) for _, nodes in regions for n in nodes)
    scaled, fixed, examples = _batch_split(scaler, graph) if k != 1 else (0, 0, [])
    return WhatIf(
        peak=after.absolute_peak,
        before=before.absolute_peak,
        checkpoint=ck,
        offload=off,
        batch=k,
        batch_size=scaler.batch_size,
        memory=after,
        baseline=before,
        recompute_flops=int(recompute * k),
        forward_flops=int(sum(flops.values()) * k),
        scaled=scaled,
        fixed=fixed,
        fixed_examples=examples,
        device=context(report)["device"] if dev is None else dev.label,
        notes=notes,
        accumulate=accumulate,
        set_to_none=set_to_none,
    )
