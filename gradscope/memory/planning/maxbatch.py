"""``report.max_batch(budget=...)``: the largest batch whose predicted step fits a budget."""

from __future__ import annotations

from dataclasses import dataclass, field

from gradscope._format import human_bytes, one_line
from gradscope.errors import InputValueError
from gradscope.memory.planning.plancode import parse_budget
from gradscope.memory.planning.whatif import what_if

__all__ = ["MaxBatch", "max_batch"]


@dataclass
class MaxBatch:
    """The largest batch whose predicted step fits ``budget`` (see :func:`max_batch`).

    ``peak`` is the step's at that batch: the higher of step 1 and a later step (``first_peak``,
    ``later_peak``; ``step`` says which one it is).
    """

    batch: int
    peak: int
    budget: int
    batch_size: int | None
    per_sample: int
    checkpoint: list[str] = field(default_factory=list)
    offload: list[str] = field(default_factory=list)
    first_peak: int = 0
    later_peak: int = 0

    @property
    def step(self) -> str:
        """Which step ``peak`` is for: ``"first step"`` or ``"later steps"`` (the higher; later on a tie)."""
        return "first step" if self.first_peak > self.later_peak else "later steps"

    @property
    def fits(self) -> bool:
        return self.batch >= 1

    def __str__(self) -> str:
        b = human_bytes
        if not self.fits:
            return f"no batch fits {b(self.budget)}: a batch of 1 needs {b(self.peak)}"
        steps = f" (step 1 {b(self.first_peak)}, later steps {b(self.later_peak)})" if self.later_peak else ""
        return (
            f"largest batch that fits {b(self.budget)}: {self.batch} (traced: {self.batch_size}), predicted "
            f"peak {b(self.peak)}{steps}; the peak grows by about {b(self.per_sample)} per sample"
        )

    __repr__ = __str__


def max_batch(
    report,
    budget,
    optimizer=None,
    *,
    checkpoint=None,
    offload=None,
    batch_size=None,
    margin: float = 0.02,
    target=None,
    accumulate: int = 1,
    set_to_none: bool = True,
) -> MaxBatch:
    """The largest integer batch whose predicted peak fits ``budget`` less ``margin`` (the prediction's
    tolerance, as in :func:`plan`), with the given changes applied.

    The peak is a replay per candidate batch: two points give the bytes per sample, the linear estimate is
    bracketed by doubling steps and the largest fitting batch found by bisection (about
    ``2 * log2(error)`` replays, never one per batch size). ``target``: the device (``"cpu"`` default,
    ``"cuda"`` modelled, or a Target). The peak is the higher of step 1 and a later step, with
    ``accumulate`` micro-steps per optimizer step and ``zero_grad(set_to_none=...)`` (:func:`what_if`).

    Raises:
        InputValueError: a bad budget or margin, no activation that shows the batch, or a step in which
            nothing grows with the batch (any batch would fit).
    """
    budget = parse_budget(budget)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 0.5:
        raise InputValueError(f"margin= is a share of the budget in [0, 0.5), got {one_line(margin)}.")
    limit = int(budget * (1 - margin))
    steps = {"target": target, "accumulate": accumulate, "set_to_none": set_to_none}
    one = what_if(report, checkpoint, offload, 1.0, optimizer, batch_size, **steps)
    b0 = one.batch_size
    if not b0:
        raise InputValueError(
            "max_batch() found no activation whose shape shows the batch size; "
            "pass batch_size= (the batch of the traced forward)."
        )

    peaks = {b0: one.peak}
    both = {b0: _both(one)}

    def peak(n: int) -> int:  # a replay per new batch; only the numbers are kept
        if n not in peaks:
            wi = what_if(report, checkpoint, offload, n / b0, optimizer, b0, **steps)
            peaks[n], both[n] = wi.peak, _both(wi)
        return peaks[n]

    growth = (peak(2 * b0) - one.peak) / b0  # bytes per sample, unrounded: a rounded one drifts far at large n
    if growth <= 0:
        raise InputValueError(
            "max_batch(): nothing in the step grows with the batch (no saved activation has the batch as its "
            f"first dimension {b0}), so no batch size is the limit; pass batch_size= if {b0} is not the batch."
        )
    lo, hi = _bracket(peak, max(1, b0 + int((limit - one.peak) // growth)), limit)
    while hi - lo > 1:  # peak(lo) <= limit < peak(hi), lo = 0 meaning "not even 1"
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid) <= limit else (lo, mid)
    n = lo
    if n == 0:
        return MaxBatch(0, peak(1), budget, b0, max(1, round(growth)), one.checkpoint, one.offload, *both[1])
    per = max(0, round((peak(n) - one.peak) / (n - b0))) if n != b0 else max(1, round(growth))
    return MaxBatch(n, peak(n), budget, b0, per, one.checkpoint, one.offload, *both[n])


def _both(wi) -> tuple[int, int]:
    return wi.first_step.absolute_peak, wi.later_step.absolute_peak


def _bracket(peak, guess: int, limit: int) -> tuple[int, int]:
    """``(lo, hi)`` with ``peak(lo) <= limit < peak(hi)`` (``lo`` 0 when batch 1 does not fit), galloping
    from ``guess``: a bounded number of replays however far the linear estimate is off."""
    step = 1
    if peak(guess) <= limit:
        lo = guess
        while peak(lo + step) <= limit:
            lo, step = lo + step, step * 2
        return lo, lo + step
    hi = guess
    while hi - step >= 1 and peak(hi - step) > limit:
        hi, step = hi - step, step * 2
    return max(0, hi - step), hi
