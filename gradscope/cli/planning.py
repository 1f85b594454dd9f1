"""``gradscope memory TARGET --budget SIZE --plan``: the plan's text and exit code, for the ``memory`` command.

The ``memory`` command (``cli/memory.py``) calls :func:`print_plan` when ``--plan`` is given: it prints the
plan (the modules, the predicted peak before and after, the recompute, the code to add) and the largest
batch that fits, and returns the exit code: 0 when a plan fits the budget, 1 when none does.
"""

from __future__ import annotations

import click

__all__ = ["print_plan", "PLAN_OPTION"]

PLAN_OPTION = click.option(
    "--plan",
    "want_plan",
    is_flag=True,
    help="With --budget: print the cheapest modules to checkpoint so that the step fits; exit 1 when none does.",
)


def print_plan(
    report,
    budget,
    optimizer=None,
    *,
    svg: str | None = None,
    echo=click.echo,
    target=None,
    accumulate: int = 1,
    set_to_none: bool = True,
) -> int:
    """Print ``report.plan(budget, optimizer)`` and the largest batch that fits; return the exit code.

    Raises:
        gradscope.errors.InputValueError: the target was not traced or the budget does not parse (the
            command turns it into a one-line usage error).
    """
    steps = {"accumulate": accumulate, "set_to_none": set_to_none}
    plan = report.plan(budget=budget, optimizer=optimizer, target=target, **steps)
    echo(str(plan))
    try:
        mb = report.max_batch(
            budget=budget,
            optimizer=optimizer,
            checkpoint=plan.checkpoint or None,
            offload=plan.offload or None,
            target=target,
            **steps,
        )
    except ValueError:  # no activation shows the batch size: say nothing about batches
        mb = None
    if mb is not None:
        with_plan = " with the plan" if plan.checkpoint or plan.offload else ""
        echo(f"\n{mb}{with_plan}")
    if svg:
        plan.to_svg(svg)
        echo(f"\nbefore/after curves: {svg}")
    return 0 if plan.fits else 1
