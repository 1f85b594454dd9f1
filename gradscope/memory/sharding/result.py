"""The answer of ``what_if(shard=...)``: :class:`ShardedStep`, one ``(low, high)`` peak per rank and its parts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gradscope._format import human_bytes

__all__ = ["ShardedStep"]


@dataclass
class ShardedStep:
    """The predicted per-rank memory of one training step under DDP or FSDP2.

    Attributes:
        spec: the :class:`gradscope.DDP` / :class:`gradscope.FSDP` it was predicted for.
        ranks: one ``(low, high)`` peak per rank, in bytes: ``low`` with every free as early as the program
            allows, ``high`` with the collectives the engine may keep in flight (equal for DDP); of the step
            that peaks higher, step 1 or a later one (the steady state: every step of a job is under it).
        parts: per rank, what is alive at its ``low`` peak, by kind (bytes; they sum to ``low``).
        before: the unchanged single-process step's peak (``backward_memory(optimizer=...).absolute_peak``).
        single: the single-process step with the same change (checkpoint, batch) and no sharding.
        change: the what-if change in words (``"checkpoint blocks.*"``), ``"no change"`` without one.
        device: the device the step runs on; notes: sentences about what is modelled and what is not.
        host_parts: with FSDP2's ``CPUOffloadPolicy``, per rank, the host's bytes at its peak by kind (sharded
            parameters, gradients, optimizer state, the step's own peak): NOTE [FSDP2 CPU offload]; empty
            without offload. ``host`` sums them per rank.
        rank: with ``inspect(model=m)`` on a rank of a DDP / FSDP2 model, that rank (its peak:
            ``ranks[rank]``); None from one process.
        first / later: one ``(low, high)`` per rank for step 1 (as inspected) and for the steps after it
            (the optimizer's state, created in the first ``step()``, alive from their start; replay/steady.py
            NOTE [first and later steps]); ``ranks`` is the higher of the two. ``later`` is empty without an
            optimizer (FSDP2: every step is the first).
    """

    spec: Any
    ranks: list[tuple[int, int]]
    parts: list[dict[str, int]]
    before: int
    single: int
    change: str = "no change"
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)
    phase: list[str] = field(default_factory=list)  # per rank: where the low peak is ("backward", ...)
    checkpoint: list[str] = field(default_factory=list)  # the modules the change checkpoints (resolved)
    groups: list[str] = field(default_factory=list)  # FSDP2: the modules fully_shard wraps before the root
    host_parts: list[dict[str, int]] = field(default_factory=list)
    rank: int | None = None  # the rank the report was inspected on (a wrapped model), else None
    later: list[tuple[int, int]] = field(default_factory=list)  # per rank, the later steps' range
    first: list[tuple[int, int]] = field(default_factory=list)  # per rank, step 1's range

    @property
    def host(self) -> list[int]:
        """Per rank, the host's peak under CPU offload (bytes; empty without offload)."""
        return [sum(p.values()) for p in self.host_parts]

    @property
    def peak_range(self) -> tuple[int, int]:
        """``(low, high)`` of the rank that peaks highest (the highest low and the highest high), of the step
        that peaks higher (step 1 or a later one)."""
        return _highest(self.ranks)

    @property
    def peak(self) -> int:
        """The floor of the highest rank's peak: ``peak_range[0]``."""
        return self.peak_range[0]

    @property
    def high(self) -> int:
        return self.peak_range[1]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def saved(self) -> int:
        """Bytes the sharding (and change) saves on the peak against the unchanged single process."""
        return self.before - self.peak

    def __str__(self) -> str:
        b = human_bytes
        lo, hi = self.peak_range
        span = b(lo) if lo == hi else f"{b(lo)} .. {b(hi)}"
        lines = [
            f"what if: {self.spec.label()}, per rank"
            + ("" if self.change == "no change" else f"; {self.change}")
            + ("" if self.rank is None else f" (inspected on rank {self.rank}: {b(self.ranks[self.rank][0])})"),
            f"  per-rank peak {span} on {self.device} (one process, unsharded: {b(self.before)})",
        ]
        host = self.host or [0] * self.world_size
        for first, last in _runs(list(zip(self.ranks, host))):
            lo_r, hi_r = self.ranks[first]
            where = f" in {self.phase[first]}" if first < len(self.phase) and self.phase[first] else ""
            label = (
                "every rank"
                if last - first + 1 == self.world_size
                else (f"rank {first}" if first == last else f"ranks {first}..{last}")
            )
            rng = b(lo_r) if lo_r == hi_r else f"{b(lo_r)} .. {b(hi_r)}"
            lines.append(f"  {label}: {rng}{where}")
            lines += _part_lines(self.parts[first])
            if self.host_parts:
                lines.append(f"  {label} on the host (CPU offload): {b(host[first])}")
                lines += _part_lines(self.host_parts[first])
        if self.later and self.first:
            (lo1, hi1), (lo2, hi2) = _highest(self.first), _highest(self.later)
            which = "step 1's" if (lo1, hi1) > (lo2, hi2) else "the later steps'"
            lines.append(
                f"  highest rank: step 1 {b(lo1) if lo1 == hi1 else f'{b(lo1)} .. {b(hi1)}'}, later steps (the "
                f"optimizer's state alive from their start) {b(lo2) if lo2 == hi2 else f'{b(lo2)} .. {b(hi2)}'}: "
                f"the per-rank peak is {which}"
            )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __repr__(self) -> str:
        lo, hi = self.peak_range
        return f"<gradscope.ShardedStep {self.spec!r}: per-rank peak {human_bytes(lo)} .. {human_bytes(hi)}>"

    def to_svg(self, path=None, *, width: int = 640) -> str:
        """One stacked bar per rank (its parts at the low peak) with the high end marked: the SVG text, or
        with ``path`` the file written and its path (as ``render(path)``)."""
        from gradscope.memory.sharding.views import ranks_svg
        from gradscope.svgchart import svg_or_path

        return svg_or_path(ranks_svg(self, width=width), path)


def _highest(ranges: list[tuple[int, int]]) -> tuple[int, int]:
    return max(lo for lo, _ in ranges), max(hi for _, hi in ranges)


def _part_lines(parts: dict[str, int]) -> list[str]:
    return [f"    {what:<36} {human_bytes(n):>10}" for what, n in sorted(parts.items(), key=lambda kv: -kv[1]) if n]


def _runs(ranks: list) -> list[tuple[int, int]]:
    """``(first, last)`` rank of each run of equal values (``((low, high), host)``)."""
    out: list[tuple[int, int]] = []
    for r, v in enumerate(ranks):
        if out and ranks[out[-1][0]] == v:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))
    return out
