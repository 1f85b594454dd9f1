"""The ``gradscope`` command line: thin click commands over :func:`gradscope.inspect` and the renderer.

Exit codes: 0 success (``check``: no error finding), 1 ``check`` found an error-severity finding,
2 a user mistake (bad TARGET, bad option, a file that cannot be written), printed as one line on stderr
without a traceback.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
import time

import click

from gradscope import __version__
from gradscope.cli.common import TRACE_OPTION, UserError, status
from gradscope.cli.rendering import flag_options, output_path, render_file, render_options
from gradscope.errors import GradscopeError
from gradscope.findings import severity_counts

__all__ = ["main"]


def _report(target: str, use_trace: bool):
    from gradscope.cli.target import load
    from gradscope.inspection import inspect

    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the target's prints must not mix with our output
            loaded = load(target, use_trace=use_trace)
            t1 = time.perf_counter()
            report = inspect(loaded.loss, model=loaded.model, trace=loaded.trace)
    except GradscopeError as exc:
        raise UserError(str(exc)) from None
    t2 = time.perf_counter()
    n = report.graph.number_of_nodes()
    status(f"inspected {n:,} nodes: {_counts(report)} (import + forward {_secs(t1 - t0)}, inspect {_secs(t2 - t1)})")
    return report


def _secs(seconds: float) -> str:
    """``2 ms``, ``1.4 s``: what a person reads at a glance."""
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _counts(report) -> str:
    return severity_counts(report.findings) or "no findings"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", prog_name="gradscope")
def main():
    """Inspect and debug PyTorch autograd graphs.

    TARGET names a function that takes no arguments and returns the loss tensor, or a (loss, model)
    tuple: path/to/file.py:function or package.module:function. Give the model to get parameter names.

    \b
    Examples:
      gradscope check train.py:make_loss        # CI gate: exit 1 on an error finding
      gradscope render train.py:make_loss -o graph.svg
      gradscope demo -o demo.svg                # a built-in example with planted bugs
      gradscope diff before.json after.json     # compare two reports saved with -o x.json

    Exit codes: 0 ok, 1 error findings (check), 2 usage or TARGET mistake.
    """


@main.command(short_help="Render TARGET's graph to .svg/.png/.pdf/.html/.dot/.json/.graphml.")
@click.argument("target")
@render_options
@TRACE_OPTION
def render(target, output, fmt, collapse, expand, show_saved, legend, rankdir, size, dpi, max_pixels, use_trace):
    """Render TARGET's autograd graph to a file (SVG by default).

    \b
    Examples:
      gradscope render train.py:make_loss -o graph.svg
      gradscope render mypkg.losses:step -o graph.html          # pan/zoom page
      gradscope render train.py:make_loss -o graph --format pdf --collapse 2
      gradscope render train.py:make_loss -o graph.json         # networkx node-link
      gradscope render big.py:step -o graph.svg --expand        # every node, nothing folded
      gradscope render train.py:make_loss -o graph.png --rankdir LR --dpi 150
    """
    output = output_path(output or f"graph.{(fmt or 'svg').lower().lstrip('.')}", fmt)
    options = flag_options(collapse, expand, show_saved, legend, (rankdir, size, dpi, max_pixels))
    report = _report(target, use_trace)
    render_file(report, output, options)
    if report.findings:
        status(f"{_counts(report)}; run `gradscope check {target}` for the details")


@main.command(short_help="Print TARGET's findings; exit 1 on an error (CI gate).")
@click.argument("target")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as a JSON list instead of text.")
@click.option(
    "--fail-on",
    type=click.Choice(["error", "warning", "info"]),
    default="error",
    show_default=True,
    help="Lowest severity that makes the exit code 1.",
)
@TRACE_OPTION
def check(target, as_json, fail_on, use_trace):
    """Print TARGET's findings; exit 1 when one is an error (a CI gate), else 0.

    \b
    Examples:
      gradscope check train.py:make_loss
      gradscope check mypkg.losses:step --json > findings.json
      gradscope check train.py:make_loss --fail-on warning
    """
    report = _report(target, use_trace)
    if as_json:
        click.echo(json.dumps([f.to_dict() for f in report.findings], indent=2))
    else:
        click.echo(report.summary())
    order = ("error", "warning", "info")
    failing = order[: order.index(fail_on) + 1]
    raise SystemExit(1 if any(f.severity in failing for f in report.findings) else 0)


@main.command(short_help="Render and check a built-in example with planted bugs.")
@render_options
@TRACE_OPTION
def demo(output, fmt, collapse, expand, show_saved, legend, rankdir, size, dpi, max_pixels, use_trace):
    """Render a built-in example with two planted bugs and print its findings.

    The example (gradscope/demo.py) is a two-head classifier: one head's output is detached, so the
    head never trains, and the sigmoid's output is clamped in place, so backward() would raise.
    Compare with `gradscope check gradscope.demo:fixed`.

    \b
    Examples:
      gradscope demo                   # writes demo.svg
      gradscope demo -o demo.html      # interactive page
    """
    output = output_path(output or f"demo.{(fmt or 'svg').lower().lstrip('.')}", fmt)
    options = flag_options(
        collapse, expand, show_saved, True if legend is None else legend, (rankdir, size, dpi, max_pixels)
    )
    report = _report("gradscope.demo:buggy", use_trace)
    render_file(report, output, options)
    click.echo(report.summary())
    click.echo(
        f"\nThe graph is in {output}. The fix is in gradscope/demo.py (TwoHeadClassifier, fixed=True); "
        "`gradscope check gradscope.demo:fixed` exits 0."
    )


def _register_diff() -> None:
    if importlib.util.find_spec("gradscope.cli.diff") is None:
        return
    from gradscope.cli.diff import diff_cmd

    main.add_command(diff_cmd, "diff")


_register_diff()


def _register_memory() -> None:
    if importlib.util.find_spec("gradscope.cli.memory") is None:
        return
    from gradscope.cli.memory import memory_cmd

    main.add_command(memory_cmd, "memory")


_register_memory()
