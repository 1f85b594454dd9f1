"""``report.max_batch(budget=...)``: the largest batch whose predicted step fits a budget."""

from __future__ import annotations

from dataclasses import dataclass, field

from gradscope._format import human_bytes
from gradscope.errors import InputValueError
from gradscope.memory.planning.plancode import parse_budget
from gradscope.memory.planning.whatif import what_if

__all__ = ["MaxBatch", "max_batch"]


@dataclass
class MaxBatch:
    """The largest batch whose predicted step fits ``budget`` (see :func:`max_batch`)."""

    batch: int
    peak: int
    budget: int
    batch_size: int | None
    per_sample: int
    checkpoint: list[str] = field(default_factory=list)
    offload: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.batch >= 1

    def __str__(self) -> str:
        b = human_bytes
        if not self.fits:
            return f"no batch fits {b(self.budget)}: a batch of 1 needs {b(self.peak)}"
        return (
            f"largest batch that fits {b(self.budget)}: {self.batch} (traced: {self.batch_size}), predicted "
            f"peak {b(self.peak)}; the peak grows by about {b(self.per_sample)} per sample"
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
) -> MaxBatch:
    """The largest integer batch whose predicted peak fits ``budget`` less ``margin`` (the prediction's
    tolerance, as in :func:`plan`), with the given changes applied.

    The peak is a replay per candidate batch: two points give the bytes per sample, then the neighbours of
    the linear estimate are replayed until the largest fitting batch is pinned down. ``target``: the
    device (``"cpu"`` default, ``"cuda"`` modelled, or a Target).
    """
    budget = parse_budget(budget)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 0.5:
        raise InputValueError(f"margin= is a share of the budget in [0, 0.5), got {margin!r}.")
    limit = int(budget * (1 - margin))
    one = what_if(report, checkpoint, offload, 1.0, optimizer, batch_size, target=target)
    b0 = one.batch_size
    if not b0:
        raise InputValueError(
            "max_batch() found no activation whose shape shows the batch size; "
            "pass batch_size= (the batch of the traced forward)."
        )

    def at(n):
        return what_if(report, checkpoint, offload, n / b0, optimizer, b0, target=target)

    two = at(2 * b0)
    per = max(1, (two.peak - one.peak) // b0)
    n = max(1, b0 + (limit - one.peak) // per)
    cache = {b0: one, 2 * b0: two}

    def peak(n):
        if n not in cache:
            cache[n] = at(n)
        return cache[n].peak

    while n > 1 and peak(n) > limit:
        n -= 1
    while peak(n + 1) <= limit:
        n += 1
    if peak(n) > limit:
        return MaxBatch(0, peak(1), budget, b0, per, one.checkpoint, one.offload)
    if n != b0:  # the growth actually seen between the traced batch and the answer (the peak may move phase)
        per = max(0, round((peak(n) - one.peak) / (n - b0)))
    return MaxBatch(n, peak(n), budget, b0, per, one.checkpoint, one.offload)
