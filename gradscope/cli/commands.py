"""The ``gradscope`` command line: thin click commands over :func:`gradscope.inspect` and the renderer.

Exit codes: 0 success (``check``: no error finding), 1 ``check`` found an error-severity finding,
2 a user mistake (bad TARGET, bad option, a file that cannot be written), printed as one line on stderr
without a traceback.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
import threading
import time
import warnings

import click

from gradscope import __version__
from gradscope.cli.common import TRACE_OPTION, UserError, status
from gradscope.errors import GradscopeError

__all__ = ["main"]

FORMATS = ("svg", "png", "pdf", "html", "dot", "json", "graphml")
_NEEDS_DOT = ("svg", "png", "pdf", "html")


_status = status


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
    _status(f"inspected {n:,} nodes: {_counts(report)} (import + forward {_secs(t1 - t0)}, inspect {_secs(t2 - t1)})")
    return report


def _secs(seconds: float) -> str:
    """``2 ms``, ``1.4 s``: what a person reads at a glance."""
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _counts(report) -> str:
    counts: dict[str, int] = {}
    for f in report.findings:
        counts[f.severity] = counts.get(f.severity, 0) + 1
    return ", ".join(f"{n} {s}{'s' if n > 1 else ''}" for s, n in counts.items()) or "no findings"


def _output_path(output: str, fmt: str | None) -> str:
    """Check ``-o`` and ``--format`` agree; return the path to write (suffix added when missing)."""
    root, suffix = os.path.splitext(output)
    suffix = suffix.lower().lstrip(".")
    if fmt is not None:
        fmt = fmt.lower().lstrip(".")
        if fmt not in FORMATS:
            raise UserError(f"Unknown --format {fmt!r}; use one of {', '.join(FORMATS)}.")
        if suffix not in FORMATS:  # no suffix, or one that is not a format (run.v2): add one
            output = f"{output}.{fmt}"
        elif suffix != fmt:
            raise UserError(
                f"-o {output!r} ends in .{suffix} but --format is {fmt!r}; make them agree (e.g. -o {root}.{fmt})."
            )
    elif suffix not in FORMATS:
        shown = f".{suffix}" if suffix else "no suffix"
        raise UserError(
            f"Cannot tell the format of -o {output!r} ({shown}); end it in one of "
            f"{', '.join('.' + f for f in FORMATS)} or pass --format."
        )
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise UserError(f"Cannot write {output!r}: the folder {folder!r} does not exist; create it first.")
    if os.path.isdir(output):
        raise UserError(
            f"Cannot write {output!r}: it is a folder; give a file name such as {os.path.join(output, 'graph.svg')!r}."
        )
    fmt = os.path.splitext(output)[1].lstrip(".").lower()
    if fmt in _NEEDS_DOT and shutil.which("dot") is None:
        raise UserError(
            f"Cannot write .{fmt}: the Graphviz 'dot' program is not on PATH; install Graphviz "
            "('apt-get install graphviz', 'brew install graphviz' or 'conda install graphviz'), or "
            "write a .dot, .json or .graphml file, which needs no Graphviz."
        )
    return output


def _render_kwargs(collapse, expand, show_saved, legend, layout=None) -> dict:
    """The renderer's keyword arguments for the options given (checked before running the target)."""
    if expand and collapse is not None:
        raise UserError(f"--expand and --collapse {collapse} contradict each other; pass one of them.")
    kwargs: dict[str, object] = {"collapse": False} if expand else {}
    rankdir, size, dpi, max_pixels = layout or (None, None, None, None)
    if rankdir:
        kwargs["rankdir"] = rankdir.upper()
    if size:
        from gradscope.views.options import size_attr as _size_attr

        try:
            kwargs["size"] = _size_attr(size)
        except GradscopeError as exc:
            raise UserError(f"--size: {exc}") from None
    if dpi:
        kwargs["dpi"] = dpi
    if max_pixels is not None:
        kwargs["max_pixels"] = max_pixels or None
    if collapse is not None:
        kwargs["collapse"] = collapse
    if show_saved is not None:
        kwargs["show_saved"] = show_saved
    if legend is not None:
        kwargs["legend"] = legend
    return kwargs


def _render(report, output: str, kwargs: dict) -> None:
    from gradscope.views.render import RenderWarning

    n = report.graph.number_of_nodes()
    fmt = os.path.splitext(output)[1].lstrip(".").lower()
    t0 = time.perf_counter()
    try:
        with (
            _ticker(fmt in _NEEDS_DOT, f"laying out {n:,} nodes with Graphviz dot"),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always", RenderWarning)
            report.render(output, **kwargs)
        for w in caught:
            _status(f"warning: {w.message}")
        if "collapse" not in kwargs and fmt in _NEEDS_DOT + ("dot",) and _boxed(output, fmt, n):
            _status(
                "collapsed automatically to fit a page (repeated blocks folded, modules boxed, findings "
                "kept open); pass --expand to draw every node or --collapse N to keep modules to depth N"
            )
    except GradscopeError as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"Cannot write {output!r}: {exc.strerror or exc}.") from None
    size = os.path.getsize(output) if os.path.exists(output) else 0
    from gradscope._format import human_bytes

    _status(f"wrote {output} ({human_bytes(size)}) in {time.perf_counter() - t0:.1f} s")


def _boxed(output: str, fmt: str, n: int) -> bool:
    """Whether the picture written folded or boxed anything (read back from text formats)."""
    from gradscope.views.render import AUTO_LIMIT

    if fmt in ("png", "pdf"):
        return n > AUTO_LIMIT
    with open(output, encoding="utf-8", errors="replace") as f:
        return "gs-group" in f.read()


@contextlib.contextmanager
def _ticker(active: bool, what: str, every: float = 5.0, first: float = 2.0):
    """While the body runs, say ``what ... (N s)`` on stderr after ``first`` seconds, then every ``every``
    seconds (one opaque dot call has no finer progress to report)."""
    if not active:
        yield
        return
    done = threading.Event()
    t0 = time.perf_counter()

    def tick():
        wait = first
        while not done.wait(wait):
            _status(f"{what} ... ({time.perf_counter() - t0:.0f} s)")
            wait = every

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


_RENDER_OPTIONS = [
    click.option(
        "-o",
        "--output",
        default=None,
        metavar="PATH",
        help="File to write; the format comes from the suffix (.svg .png .pdf .html .dot .json .graphml).",
    ),
    click.option(
        "-f",
        "--format",
        "fmt",
        default=None,
        metavar="F",
        help=f"Output format when -o has no suffix: {', '.join(FORMATS)}.",
    ),
    click.option(
        "--collapse",
        type=click.IntRange(min=0),
        default=None,
        metavar="N",
        help="Box every module deeper than N (default: the drawing that fits a page: repeated "
        "blocks folded, modules boxed to the depth that fits, findings kept open).",
    ),
    click.option("--expand", is_flag=True, help="Draw every node: nothing folded or boxed."),
    click.option(
        "--show-saved/--no-show-saved", default=None, help="Show each op's saved tensors (shape, dtype, bytes)."
    ),
    click.option("--legend/--no-legend", default=None, help="Add a legend box to the picture."),
    click.option(
        "--rankdir",
        type=click.Choice(["TB", "LR"], case_sensitive=False),
        default=None,
        help="Layout direction: TB (top to bottom) or LR (left to right); default: what fits.",
    ),
    click.option(
        "--size",
        default=None,
        metavar="W,H",
        help="Largest picture size in inches, e.g. 8,10 (a bigger drawing is scaled down).",
    ),
    click.option("--dpi", type=click.FloatRange(min=1), default=None, help="Dots per inch of .png output."),
    click.option(
        "--max-pixels",
        type=click.IntRange(min=0),
        default=None,
        metavar="N",
        help="Scale a .png down to N pixels on its longer side (default 8000; 0: no cap).",
    ),
]


def _render_options(fn):
    for option in reversed(_RENDER_OPTIONS):
        fn = option(fn)
    return fn


_TRACE_OPTION = TRACE_OPTION


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
@_render_options
@_TRACE_OPTION
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
    output = _output_path(output or f"graph.{(fmt or 'svg').lower().lstrip('.')}", fmt)
    kwargs = _render_kwargs(collapse, expand, show_saved, legend, (rankdir, size, dpi, max_pixels))
    report = _report(target, use_trace)
    _render(report, output, kwargs)
    if report.findings:
        _status(f"{_counts(report)}; run `gradscope check {target}` for the details")


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
@_TRACE_OPTION
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
@_render_options
@_TRACE_OPTION
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
    output = _output_path(output or f"demo.{(fmt or 'svg').lower().lstrip('.')}", fmt)
    kwargs = _render_kwargs(
        collapse, expand, show_saved, True if legend is None else legend, (rankdir, size, dpi, max_pixels)
    )
    report = _report("gradscope.demo:buggy", use_trace)
    _render(report, output, kwargs)
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
