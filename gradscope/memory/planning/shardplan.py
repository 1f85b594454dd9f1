"""``report.plan(budget, shard=...)`` and ``report.max_batch(budget, shard=...)``: per rank.

NOTE [sharded plans]
A spec is tried as given, then with the cheaper-to-fit settings in order of cost: FSDP2 resharding after
forward (an all-gather more per group in backward), then a checkpoint per ``fully_shard`` module (its
forward again), then ``CPUOffloadPolicy`` (every shard copied to the device and every gradient back each
step, and the optimizer step on the host: the slowest), alone and with the checkpoint. Offload is tried
only when the step runs on an accelerator: on the CPU it moves nothing (NOTE [FSDP2 CPU offload]).
``shard="auto"`` looks for the smallest world size (1, 2, 4, ... 1024) at which one of
these fits, unsharded first: a step that fits one process needs no sharding, and DDP never lowers a
rank's peak, so the sharded candidates are FSDP2's. A candidate fits when the *ceiling* of its highest
rank (``peak_range[1]``, the device's) is within the budget less ``margin``.

Mixed precision (``mixed_precision=True``, the default, with FSDP2 on float32 parameters and no
``mp_policy`` in the spec): each setting above is tried as the spec gives it, then with
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``, the common recipe,
before any slower setting. It costs no time (half the all-gather bytes, bfloat16 compute on a device), so
it comes before the next time cost; it changes the numerics, so the float32 setting of the same cost comes
first, and a plan that switches it on says so in its printout and in the code it writes. On by default
because the question a plan answers is "what makes it fit", and bfloat16 parameters are how FSDP2 runs are
usually trained; ``mixed_precision=False`` keeps the spec's precision. Its prediction replays the forward in
bfloat16, so where the model computes in float32 on purpose the peak is low (NOTE [FSDP2 mixed precision]).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gradscope._format import human_bytes
from gradscope.errors import InputValueError
from gradscope.memory.planning.maxbatch import MaxBatch
from gradscope.memory.planning.plancode import parse_budget, plan_code
from gradscope.memory.planning.sharded import check_spec, sharded_what_if
from gradscope.memory.planning.whatif import context, what_if
from gradscope.memory.sharding.precision import params_dtype
from gradscope.memory.sharding.result import ShardedStep
from gradscope.memory.sharding.specs import DDP, FSDP

__all__ = ["ShardPlan", "shard_plan", "sharded_max_batch"]

_WORLDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass
class ShardPlan:
    """The cheapest sharded setting that fits ``budget`` per rank (see :func:`shard_plan`)."""

    budget: int
    spec: DDP | FSDP | None
    checkpoint: list[str]
    fits: bool
    peak_range: tuple[int, int]
    result: ShardedStep | None = None
    tried: list[str] = field(default_factory=list)
    message: str = ""
    mixed_precision: bool = False  # the search switched bfloat16 parameters on (NOTE [sharded plans])

    @property
    def peak(self) -> int:
        return self.peak_range[0]

    @property
    def code(self) -> str:
        parts = [plan_code(self.checkpoint, [])] if self.checkpoint else []
        if self.spec is not None:
            parts.append(self.spec.code(self.result.groups if self.result and self.result.groups else None))
            if self.mixed_precision:
                parts[-1] = f"# {_MIXED}\n{parts[-1]}"
        return "\n\n".join(p for p in parts if p)

    def __str__(self) -> str:
        b = human_bytes
        lo, hi = self.peak_range
        if not self.fits:
            head = f"budget {b(self.budget)} per rank: nothing tried fits"
        elif self.spec is None:
            head = f"budget {b(self.budget)}: fits one process unsharded (peak {b(lo)})"
        else:
            ck = f" + checkpoint {', '.join(self.checkpoint)}" if self.checkpoint else ""
            head = f"budget {b(self.budget)} per rank: {self.spec.label()}{ck} fits (per-rank peak {b(lo)} .. {b(hi)})"
        lines = [head] + [f"  tried: {t}" for t in self.tried]
        if self.mixed_precision:
            lines.append(f"  mixed precision switched on: {_MIXED}")
        if self.message:
            lines.append("  " + self.message)
        if self.fits and self.code:
            lines += ["", "The code:", *(("    " + ln).rstrip() for ln in self.code.splitlines())]
        return "\n".join(lines)

    __repr__ = __str__


_MIXED = (
    "bfloat16 parameters with a float32 gradient reduce: faster, but the numerics change "
    "(plan(..., mixed_precision=False) keeps the parameters' precision)"
)


def _variants(spec: DDP | FSDP, device: str, mixed: bool) -> list[tuple[DDP | FSDP, bool]]:
    """``(spec, checkpoint the sharded modules)`` in order of cost (NOTE [sharded plans]); ``mixed``: each
    FSDP2 setting also with bfloat16 parameters and a float32 reduce, right after it."""
    out = _by_time(spec, device)
    if not mixed or not isinstance(spec, FSDP) or spec.param_dtype:
        return out
    both: list[tuple[DDP | FSDP, bool]] = []
    for s, ck in out:
        both += [(s, ck), (_bf16(s), ck)] if isinstance(s, FSDP) else [(s, ck)]
    return both


def _bf16(spec: FSDP) -> FSDP:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return replace(spec, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


def _by_time(spec: DDP | FSDP, device: str) -> list[tuple[DDP | FSDP, bool]]:
    if isinstance(spec, DDP):
        return [(spec, False), (spec, True)]
    out: list[tuple[DDP | FSDP, bool]] = [(spec, False)]
    if spec.reshard_after_forward is not True:
        out.append((replace(spec, reshard_after_forward=True), False))
    resharded = replace(spec, reshard_after_forward=True)
    out.append((resharded, True))
    if device != "cpu" and not spec.offload:
        off = _offloaded(resharded)
        out += [(off, False), (off, True)]
    return out


def _offloaded(spec: FSDP) -> FSDP:
    from torch.distributed.fsdp import CPUOffloadPolicy

    return replace(spec, offload_policy=CPUOffloadPolicy())


def shard_plan(
    report, budget, optimizer=None, shard="auto", *, margin: float = 0.02, mixed_precision: bool = True, **kw
) -> ShardPlan:
    """The smallest world size, then the cheapest setting, whose per-rank ceiling fits ``budget``.

    Args:
        shard: a :class:`gradscope.DDP` / :class:`gradscope.FSDP` (its world size kept), or ``"auto"``:
            FSDP2 over ``modules`` (``kw["modules"]``, default ``["blocks.*"]``) at growing world sizes.
        mixed_precision: also try FSDP2 with bfloat16 parameters and a float32 reduce when the parameters
            are float32 (it changes the numerics: False keeps the spec's precision; NOTE [sharded plans]).
    """
    limit = int(parse_budget(budget) * (1 - margin))
    modules = kw.pop("modules", ("blocks.*",))
    tried: list[str] = []
    if shard == "auto":
        one = what_if(report, optimizer=optimizer, **kw)
        tried.append(f"one process: {human_bytes(one.peak)}")
        if one.peak <= limit:
            return ShardPlan(parse_budget(budget), None, [], True, (one.peak, one.peak), None, tried)
        specs: list[DDP | FSDP] = [FSDP(w, modules=modules, reshard_after_forward=False) for w in _WORLDS if w > 1]
    else:
        specs = [check_spec(shard)]
    device = context(report)["device"] if kw.get("target") is None else what_if(report, **kw).device
    mixed = mixed_precision and params_dtype(report.graph) == "float32"
    best = None
    previous = None  # the best ceiling at the previous world size
    for spec in specs:
        here = None
        for variant, ck in _variants(spec, device, mixed):
            pats = list(variant.modules) if isinstance(variant, FSDP) else list(modules)
            step = sharded_what_if(report, variant, pats if ck else None, None, 1.0, optimizer, **kw)
            lo, hi = step.peak_range
            tried.append(f"{variant.label()}{' + checkpoint' if ck else ''}: {human_bytes(lo)} .. {human_bytes(hi)}")
            if hi <= limit:
                switched = isinstance(variant, FSDP) and variant.param_dtype != getattr(spec, "param_dtype", None)
                fit = ShardPlan(parse_budget(budget), variant, step.checkpoint, True, (lo, hi), step, tried)
                fit.mixed_precision = switched
                return fit
            here = hi if here is None else min(here, hi)
            if best is None or hi < best[2].peak_range[1]:
                best = (variant, ck, step)
        if previous is not None and here is not None and here >= previous:
            break  # more ranks no longer lower the ceiling: padding and activations dominate
        previous = here
    if best is None:
        raise InputValueError("plan(shard=...) had nothing to try.")
    notes = [] if mixed else ["mixed precision was tried only as the spec gives it"]
    if device == "cpu":
        notes.append("CPU offload moves nothing on the CPU, so it was not tried")
    msg = "; ".join(notes)
    return ShardPlan(parse_budget(budget), best[0], best[2].checkpoint, False, best[2].peak_range, best[2], tried, msg)


def sharded_max_batch(report, budget, optimizer=None, shard=None, *, margin: float = 0.02, **kw) -> MaxBatch:
    """The largest integer batch whose per-rank ceiling fits ``budget`` under ``shard`` (batch 0 when none)."""
    limit = int(parse_budget(budget) * (1 - margin))
    b0 = what_if(report, optimizer=optimizer, **kw).batch_size
    if not b0:
        raise InputValueError(
            "max_batch(shard=...) found no activation whose shape shows the batch size; pass batch_size=."
        )

    seen: dict[int, int] = {}

    def high(n: int) -> int:
        if n not in seen:
            seen[n] = sharded_what_if(report, shard, batch=n / b0, optimizer=optimizer, batch_size=b0, **kw).high
        return seen[n]

    ck, off = list(kw.get("checkpoint") or []), list(kw.get("offload") or [])
    if high(1) > limit:
        return MaxBatch(0, high(1), parse_budget(budget), b0, 0, ck, off)
    lo, hi = 1, 2
    while high(hi) <= limit:  # the ceiling grows with the batch: double, then bisect
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if high(mid) <= limit else (lo, mid)
    per = max(0, round((high(lo) - high(1)) / (lo - 1))) if lo > 1 else 0
    return MaxBatch(lo, high(lo), parse_budget(budget), b0, per, ck, off)
