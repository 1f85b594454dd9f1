"""What ``gradscope render`` and ``gradscope demo`` share: the output path and format, the render options
(``--collapse``, ``--rankdir``, ``--size``...), the progress ticker for slow layouts, and writing the file."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import warnings

import click

from gradscope.cli.common import UserError, status
from gradscope.errors import GradscopeError
from gradscope.views.formats import LAYOUT, NAMES
from gradscope.views.options import RenderOptions, size_attr

__all__ = ["FORMATS", "output_path", "flag_options", "render_file", "render_options"]

#: The output formats (the rows of gradscope.views.formats.FORMATS).
FORMATS = NAMES


def output_path(output: str, fmt: str | None) -> str:
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
    if fmt in LAYOUT and shutil.which("dot") is None:
        raise UserError(
            f"Cannot write .{fmt}: the Graphviz 'dot' program is not on PATH; install Graphviz "
            "('apt-get install graphviz', 'brew install graphviz' or 'conda install graphviz'), or "
            "write a .dot, .json or .graphml file, which needs no Graphviz."
        )
    return output


def flag_options(collapse, expand, show_saved, legend, layout=None) -> RenderOptions:
    """The render options the flags ask for (checked before running the target)."""
    if expand and collapse is not None:
        raise UserError(f"--expand and --collapse {collapse} contradict each other; pass one of them.")
    rankdir, size, dpi, max_pixels = layout or (None, None, None, None)
    given = {
        "collapse": False if expand else collapse,
        "rankdir": rankdir or None,
        "dpi": dpi or None,
        "show_saved": show_saved,
        "legend": legend,
    }
    kwargs = {k: v for k, v in given.items() if v is not None}
    if max_pixels is not None:
        kwargs["max_pixels"] = max_pixels or None  # 0: no cap
    try:
        if size:
            kwargs["size"] = size_attr(size)
    except GradscopeError as exc:
        raise UserError(f"--size: {exc}") from None
    try:
        return RenderOptions.of(**kwargs)
    except GradscopeError as exc:
        raise UserError(str(exc)) from None


def render_file(report, output: str, options: RenderOptions) -> None:
    from gradscope.views.render import RenderWarning

    n = report.graph.number_of_nodes()
    fmt = os.path.splitext(output)[1].lstrip(".").lower()
    t0 = time.perf_counter()
    try:
        with (
            ticker(fmt in LAYOUT, f"laying out {n:,} nodes with Graphviz dot"),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always", RenderWarning)
            report.render(output, options=options)
        for w in caught:
            status(f"warning: {w.message}")
        if options.collapse is None and (fmt in LAYOUT or fmt == "dot") and boxed_output(output, fmt, n):
            status(
                "collapsed automatically to fit a page (repeated blocks folded, modules boxed, findings "
                "kept open); pass --expand to draw every node or --collapse N to keep modules to depth N"
            )
    except GradscopeError as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"Cannot write {output!r}: {exc.strerror or exc}.") from None
    size = os.path.getsize(output) if os.path.exists(output) else 0
    from gradscope._format import human_bytes

    status(f"wrote {output} ({human_bytes(size)}) in {time.perf_counter() - t0:.1f} s")


def boxed_output(output: str, fmt: str, n: int) -> bool:
    """Whether the picture written folded or boxed anything (read back from text formats)."""
    from gradscope.views.options import AUTO_LIMIT

    if fmt in ("png", "pdf"):
        return n > AUTO_LIMIT
    with open(output, encoding="utf-8", errors="replace") as f:
        return "gs-group" in f.read()


@contextlib.contextmanager
def ticker(active: bool, what: str, every: float = 5.0, first: float = 2.0):
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
            status(f"{what} ... ({time.perf_counter() - t0:.0f} s)")
            wait = every

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


RENDER_OPTIONS = [
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


def render_options(fn):
    for option in reversed(RENDER_OPTIONS):
        fn = option(fn)
    return fn
