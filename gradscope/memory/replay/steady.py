"""The first optimizer step and the ones after it: which is higher decides "will it fit".

NOTE [first and later steps]
``backward_memory(optimizer=...)`` is asked between a forward and its backward. What is alive then is
the step as it stands (its ``.grad`` and optimizer state as inspected): the *first step*. Every later step
of the same loop (``zero_grad()``, forward, backward, ``optimizer.step()``) starts from what the first one
left: the optimizer's state, created inside the first ``optimizer.step()`` (AdamW: two parameter-sized
tensors per parameter), is alive from the start, together with the activations and, while backward runs,
the gradients. Its peak is what runs out of memory at step 2 of a job told it fits at step 1.

The replay models both from the same graph (each step's forward saves the same tensors):

- the first step: backward with ``.grad`` as inspected, then ``optimizer.step()`` creating the state the
  optimizer lacks. With ``accumulate=k`` micro-steps per optimizer step, micro-steps 2..k run with every
  reached parameter's ``.grad`` set (backward adds into it), and the optimizer step follows the last one.
- a later step: the optimizer's state as the first step leaves it (what it has now plus what its first
  ``step()`` creates), ``.grad`` cleared by ``zero_grad()`` (``set_to_none=True``, torch's default: the
  first micro-step creates the gradients) or kept as zeros (``set_to_none=False``: every micro-step adds
  into them), then ``optimizer.step()`` with no new state.

``absolute_peak`` is the higher of the two (``first_step`` and ``later_step`` each give theirs). Input
leaves (a batch that requires grad) are new tensors every step: no ``.grad`` at the start of either.
Without an optimizer the later step is the same loop without state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StepPeak", "steps_of"]


@dataclass(frozen=True)
class StepPeak:
    """One optimizer step's absolute memory (bytes).

    Attributes:
        name: ``"first step"`` or ``"later steps"``.
        parts: what is alive when its (first) backward starts, by kind; ``base`` is their sum.
        backward_peak: the highest absolute level during its backward (of every micro-step).
        optimizer_peak: the highest absolute level during its ``optimizer.step()`` (None without one).
        absolute_peak: the larger of the two.
        micro_steps: ``(name, base, rise above that base)`` per distinct micro-step (``accumulate > 1``:
            the first and the ones that add into ``.grad``).
    """

    name: str
    parts: dict
    base: int
    backward_peak: int
    optimizer_peak: int | None
    absolute_peak: int
    micro_steps: tuple = field(default=())
    how: str = ""  #: in a few words, what this step starts with

    def grown(self, nbytes: int, part: str) -> StepPeak:
        """The same step with ``nbytes`` more alive throughout it, counted in ``parts[part]``."""
        parts = {**self.parts, part: self.parts.get(part, 0) + nbytes}
        opt = None if self.optimizer_peak is None else self.optimizer_peak + nbytes
        micro = tuple((label, base + nbytes, rise) for label, base, rise in self.micro_steps)
        return StepPeak(
            self.name,
            parts,
            self.base + nbytes,
            self.backward_peak + nbytes,
            opt,
            self.absolute_peak + nbytes,
            micro,
            self.how,
        )

    @property
    def phase(self) -> str:
        """Where this step's peak is: ``"backward"`` or ``"optimizer.step()"``."""
        if self.optimizer_peak is not None and self.optimizer_peak > self.backward_peak:
            return "optimizer.step()"
        return "backward"


def grad_variants(prog, has_grad: dict) -> tuple[dict, dict]:
    """``(none, set)``: leaf index -> ``.grad`` set, with no gradient at all, and with every parameter's set
    (an input leaf is a new tensor every step: never set)."""
    info = prog.leaves()
    none = dict.fromkeys(has_grad, False)
    every = {i: info.get(i, ("param", None))[0] == "param" for i in has_grad}
    return none, every


def steps_of(
    *, parts_of, trace_of, cur: dict, variants: tuple, first_budget, later_budget, accumulate: int, set_to_none: bool
) -> tuple[StepPeak, StepPeak]:
    """The first and the later step (NOTE [first and later steps]).

    ``parts_of(has_grad, others, state)``: what is alive at backward's start, by kind, with ``.grad`` set as
    ``has_grad`` says (``others``: the ``.grad`` of parameters the graph does not reach: None as inspected,
    False cleared) and ``state`` bytes of optimizer state; ``trace_of(has_grad)``: the simulated backward;
    ``cur``: ``.grad`` as inspected; ``variants``: :func:`grad_variants`; the budgets: ``optimizer.step()``
    of the first and of a later step (None without an optimizer).
    """
    none, every = variants
    s0 = first_budget.state_before if first_budget is not None else 0
    s1 = s0 + first_budget.state_new if first_budget is not None else 0

    def one(name, micro, budget, state, how):
        out = []
        for label, hg, others in micro:
            parts = parts_of(hg, others, state)
            base = sum(parts.values())
            tr = trace_of(hg)
            out.append((label, base, max(tr.peak, 0), tr.end, parts))
        _, base_last, _, end_last, _ = out[-1]
        opt = None if budget is None else base_last + end_last + budget.peak
        bwd = max(base + rise for _, base, rise, _, _ in out)
        return StepPeak(
            name,
            out[0][4],
            out[0][1],
            bwd,
            opt,
            bwd if opt is None else max(bwd, opt),
            tuple((label, base, rise) for label, base, rise, _, _ in out),
            how,
        )

    first: list[tuple[str, dict, bool | None]] = [("micro-step 1", cur, None)]
    if accumulate > 1:
        first.append((f"micro-steps 2-{accumulate}", {i: g or every[i] for i, g in cur.items()}, None))
    later: list[tuple[str, dict, bool | None]] = [
        ("micro-step 1", none, False) if set_to_none else ("micro-step 1", every, None)
    ]
    if accumulate > 1:
        later.append((f"micro-steps 2-{accumulate}", every, False if set_to_none else None))
    opt = first_budget.name if first_budget is not None else None
    k = f"; {accumulate} micro-steps per optimizer step" if accumulate > 1 else ""
    has = any(cur.values())
    how1 = "as inspected: " + (".grad set" if has else ".grad empty")
    if opt is not None:
        how1 += f", {opt} state {'of earlier steps' if s0 else 'not created yet'}"
    how2 = (f"{opt}'s state alive from the start; " if opt is not None else "") + (
        "zero_grad() empties .grad" if set_to_none else "zero_grad(set_to_none=False) keeps .grad as zeros"
    )
    return (one("first step", first, first_budget, s0, how1 + k), one("later steps", later, later_budget, s1, how2 + k))
