"""``gradscope memory TARGET [--optimizer adamw] [--budget 16GiB]``: will the training step fit?

Prints the step budget and backward's peak (``report.backward_memory()``); with ``--budget``, exits 1 when
the predicted absolute peak exceeds it (a CI gate for "this config still fits"). Same TARGET rules as
``render``/``check``; the optimizer is built over the model TARGET returns.

Hook for planning: when ``gradscope/cli/planning.py`` exists, its ``PLAN_OPTION`` adds
``--plan`` here and ``print_plan(report, budget, optimizer, svg=..., echo=...)`` prints the plan and gives
the exit code.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys

import click

from gradscope.cli.common import TRACE_OPTION, UserError, status
from gradscope.cli.sharding import SHARD_OPTIONS, print_sharded, shard_spec
from gradscope.errors import GradscopeError, InputValueError

__all__ = ["memory_cmd", "OPTIMIZERS", "make_optimizer"]

#: ``--optimizer`` names -> (class name in torch.optim, keyword arguments).
OPTIMIZERS = {
    "sgd": ("SGD", {"lr": 0.01}),
    "sgd-momentum": ("SGD", {"lr": 0.01, "momentum": 0.9}),
    "adam": ("Adam", {}),
    "adamw": ("AdamW", {}),
    "rmsprop": ("RMSprop", {}),
    "adagrad": ("Adagrad", {}),
}


def make_optimizer(name: str, model):
    """A fresh ``torch.optim`` optimizer named ``name`` over ``model``'s parameters (its state is created
    by the first step, as in the predicted one)."""
    import torch

    if model is None:
        raise InputValueError(f"--optimizer {name} needs the model: make TARGET return (loss, model).")
    cls, kwargs = OPTIMIZERS[name]
    return getattr(torch.optim, cls)([p for p in model.parameters() if p.requires_grad], **kwargs)


def _plan_hook():
    if importlib.util.find_spec("gradscope.cli.planning") is None:
        return None
    from gradscope.cli import planning

    return planning


def _options(fn):
    hook = _plan_hook()
    if hook is not None:
        fn = hook.PLAN_OPTION(fn)
    return SHARD_OPTIONS(fn)


@click.command("memory", short_help="Predict TARGET's backward and optimizer-step memory; exit 1 over --budget.")
@click.argument("target")
@click.option(
    "--optimizer",
    "opt_name",
    type=click.Choice(sorted(OPTIMIZERS), case_sensitive=False),
    default=None,
    help="Add optimizer.step() to the budget (state created on the first step, then kept).",
)
@click.option(
    "--budget",
    default=None,
    metavar="SIZE",
    help="Exit 1 when the predicted absolute peak exceeds SIZE (e.g. 16GiB, '16 GB', 512MiB).",
)
@click.option("--svg", "svg", default=None, metavar="PATH", help="Write the memory-over-backward curve to PATH.")
@click.option(
    "--target",
    "device",
    type=click.Choice(["cpu", "cuda"], case_sensitive=False),
    default=None,
    help="The device to predict for (default cpu; cuda is modelled, not measured). A forward on meta "
    "tensors then takes that device's kernels.",
)
@click.option(
    "--accumulate",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="N",
    help="Backward passes per optimizer.step() (gradient accumulation).",
)
@click.option(
    "--keep-grads",
    is_flag=True,
    help="zero_grad(set_to_none=False): .grad kept as zeros between steps (default: emptied).",
)
@TRACE_OPTION
@_options
def memory_cmd(target, opt_name, budget, svg, accumulate, keep_grads, use_trace, device=None, want_plan=False, **shard):
    """Predict the memory of TARGET's backward() and training step, before running it.

    \b
    Examples:
      gradscope memory train.py:make_loss
      gradscope memory train.py:make_loss --optimizer adamw --budget 16GiB   # exit 1 when it won't fit
      gradscope memory train.py:make_loss --svg curve.svg
      gradscope memory train.py:make_loss --target cuda --budget 80GiB      # modelled, not measured
      gradscope memory train.py:make_loss --optimizer adamw --budget 80GiB --fsdp 8   # per rank
      gradscope memory train.py:make_loss --optimizer adamw --accumulate 4 --budget 16GiB

    The budget is compared with the higher of step 1 and a later step (the optimizer's state alive from
    its start); both are printed.
    """
    from gradscope._format import human_bytes
    from gradscope.cli.target import load
    from gradscope.inspection import inspect
    from gradscope.memory.meta import kernels_on_meta

    if want_plan and budget is None:  # before the replay: the plan cannot run without it
        raise UserError("--plan needs --budget SIZE (the memory the plan must fit in), e.g. --budget 16GiB.")
    limit = None
    try:
        if budget is not None:
            from gradscope.memory.planning.plancode import budget_note, parse_budget

            limit = parse_budget(budget)
            note = budget_note(budget)
            if note:
                status(note)
        kernels = kernels_on_meta(device.lower()) if device else contextlib.nullcontext()
        with contextlib.redirect_stdout(sys.stderr), kernels:  # the target's prints must not mix with our output
            loaded = load(target, use_trace=use_trace)
        report = inspect(loaded.loss, model=loaded.model, trace=loaded.trace)
        opt = make_optimizer(opt_name.lower(), loaded.model) if opt_name else None
        spec = shard_spec(**shard)
        steps = {"accumulate": accumulate, "set_to_none": not keep_grads}
        if spec is not None:
            sys.exit(print_sharded(report, spec, opt, limit, svg=svg, plan=want_plan, **steps))
        bm = report.backward_memory(optimizer=opt, target=device and device.lower(), **steps)
    except GradscopeError as exc:
        raise UserError(str(exc)) from None
    status(f"replayed {len(bm.order):,} nodes")
    click.echo(str(bm))
    if svg:
        try:
            bm.to_svg(svg, budget=limit)
        except OSError as exc:
            raise UserError(f"cannot write {svg!r}: {exc.strerror or exc}.") from None
        click.echo(f"\ncurve: {svg}")
    if want_plan:
        try:
            code = _plan_hook().print_plan(
                report, budget, opt, echo=click.echo, target=device and device.lower(), **steps
            )
        except GradscopeError as exc:
            raise UserError(str(exc)) from None
        sys.exit(code)
    if limit is not None:
        over = bm.absolute_peak > limit
        verdict = "does NOT fit" if over else "fits"
        first, later = bm.first_step.absolute_peak, bm.later_step.absolute_peak
        which = "step 1" if first > later else "the later steps"
        click.echo(
            f"\nbudget {human_bytes(limit)}: the step {verdict} (predicted absolute peak "
            f"{human_bytes(bm.absolute_peak)}, {which}'; step 1 {human_bytes(first)}, later steps "
            f"{human_bytes(later)})."
        )
        if over:
            sys.exit(1)
