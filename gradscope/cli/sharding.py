"""``gradscope memory TARGET --fsdp 8`` / ``--ddp 8``: the per-rank step, for the ``memory`` command.

The ``memory`` command (``cli/memory.py``) takes :data:`SHARD_OPTIONS` and calls :func:`print_sharded`
when ``--ddp`` or ``--fsdp`` is given: it prints ``report.what_if(shard=...)`` (one peak range per rank and
its parts) and returns the exit code: 1 when ``--budget`` is given and the highest rank's ceiling exceeds it.
"""

from __future__ import annotations

import click

from gradscope.cli.common import UserError

__all__ = ["SHARD_OPTIONS", "print_sharded", "shard_spec"]


def SHARD_OPTIONS(fn):
    """``--ddp N``, ``--fsdp N``, ``--shard-modules PATTERN`` (repeatable), ``--bucket-view``."""
    for opt in (
        click.option("--bucket-view", is_flag=True, help="With --ddp: gradient_as_bucket_view=True."),
        click.option(
            "--shard-modules",
            "shard_modules",
            multiple=True,
            metavar="PATTERN",
            help="With --fsdp: the modules passed to fully_shard before the root (default 'blocks.*').",
        ),
        *(
            click.option(f"--{kind}", kind, type=click.IntRange(min=1), default=None, metavar="N", help=text)
            for kind, text in (
                ("fsdp", "Predict each rank of an FSDP2 (fully_shard) step on N ranks."),
                ("ddp", "Predict each rank of a DistributedDataParallel step on N ranks."),
            )
        ),
    ):
        fn = opt(fn)
    return fn


def shard_spec(ddp, fsdp, shard_modules=(), bucket_view=False):
    """The spec the options name (None when neither is given)."""
    from gradscope.memory.sharding.specs import DDP, FSDP

    if ddp and fsdp:
        raise UserError("give --ddp N or --fsdp N, not both.")
    if ddp:
        return DDP(ddp, gradient_as_bucket_view=bool(bucket_view))
    if fsdp:
        return FSDP(fsdp, modules=tuple(shard_modules) or ("blocks.*",))
    if shard_modules or bucket_view:
        raise UserError("--shard-modules and --bucket-view go with --fsdp N / --ddp N.")
    return None


def print_sharded(
    report,
    spec,
    optimizer=None,
    limit: int | None = None,
    *,
    svg=None,
    plan: bool = False,
    echo=click.echo,
    accumulate: int = 1,
    set_to_none: bool = True,
) -> int:
    """Print the per-rank step; 1 when ``limit`` is given and the highest rank's ceiling exceeds it. With
    ``plan``: print ``report.plan(limit, shard=spec)`` instead (the cheapest setting that fits), 1 when none."""
    from gradscope._format import human_bytes

    if plan:
        if limit is None:
            raise UserError("--plan needs --budget SIZE (the memory the plan must fit in).")
        found = report.plan(limit, optimizer=optimizer, shard=spec, accumulate=accumulate, set_to_none=set_to_none)
        echo(str(found))
        return 0 if found.fits else 1

    step = report.what_if(optimizer=optimizer, shard=spec, accumulate=accumulate, set_to_none=set_to_none)
    echo(str(step))
    if svg:
        try:
            step.to_svg(svg)
        except OSError as exc:
            raise UserError(f"cannot write {svg!r}: {exc.strerror or exc}.") from None
        echo(f"\nper-rank bars: {svg}")
    if limit is None:
        return 0
    lo, hi = step.peak_range
    over = hi > limit
    echo(
        f"\nbudget {human_bytes(limit)} per rank: the step {'does NOT fit' if over else 'fits'} "
        f"(predicted per-rank peak {human_bytes(lo)} .. {human_bytes(hi)})."
    )
    return 1 if over else 0
