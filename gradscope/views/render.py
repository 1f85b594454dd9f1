"""Graph views of a report: SVG/PNG/PDF (through Graphviz ``dot``), HTML, DOT, JSON and GraphML.

Legend (the same in every view; docs/pictures.md shows it with pictures):

=====================  ============================================================================
element                drawing
=====================  ============================================================================
parameter              light-blue rounded box, blue border: name, shape, dtype; drawn beside the op
                       that reads it
input                  light-green box: a leaf that requires grad but is not a named parameter
op                     rounded box: backward node name, output shape, saved tensors
                       (``slot: shape dtype bytes``, toggle with ``show_saved``) and ``holds X``: the
                       activation bytes it keeps alive (each storage counted once, at its first saver;
                       parameters saved by reference cost nothing extra and are left out). The fill goes
                       from white to orange with those bytes: memory hot spots stand out
root                   an op with a double border, labelled ``root -> shape``
module                 grey rounded cluster around the ops of one module call (``NAME (call 2)`` for
                       a module run again later); from ``trace()``, or inferred from parameters
collapsed module       violet 3-D box: ``NAME (collapsed)``, op count, activation bytes
repetition             violet 3-D box ``x12  repeated block``: unrolled steps or repeated layers folded
                       into one box, with the ops of one repetition and the modules it runs over
chain                  violet 3-D box ``5 ops: Pow, Mean, ...``: a run of ops one after the other
                       (only when nothing else makes the drawing fit a page)
shared leaf            small dashed box, ``shared xK``: one stub per use of a leaf used K times
finding                red thick border, larger text and a ``!! kind`` line: never folded or boxed;
                       the modules around it stay open down to it
unused parameters      red dashed cluster "no gradient": parameters no path from the root reaches, one
                       box per parameter (or per module when there are many), in a grid
cut                    red octagon ``CUT: detach`` with its ``file:line`` (needs ``trace()``), linked
                       to the parameters it cut off
outside stub           small dashed box ``from nK ...`` in the drawing of one opened box
                       (:func:`drawing` with ``box=``): the ops just outside it
=====================  ============================================================================

Edges point in data-flow direction (inputs at the top, the root at the bottom; ``rankdir="LR"``: left
to right).

The default drawing is the most detailed one that fits a page (:mod:`gradscope.views.fit`, NOTE [fitting
a page]); the caption says what was folded or boxed and how to see everything (``collapse=False``).
"""

from __future__ import annotations

import os
from typing import Any

import graphviz

from gradscope.errors import InputTypeError, InputValueError, RenderError
from gradscope.views.drawing import drawing, pipe
from gradscope.views.fit import MAX_LAYOUT, TooBigToLayOut
from gradscope.views.formats import NAMES, find, graphml_ready, too_big, unknown
from gradscope.views.options import AUTO_LIMIT, MAX_PIXELS, RANKDIRS, RenderOptions, RenderWarning, ReportLike

__all__ = [
    "render",
    "to_dot",
    "drawing",
    "pipe",
    "graphml_ready",
    "FORMATS",
    "RANKDIRS",
    "AUTO_LIMIT",
    "MAX_PIXELS",
    "RenderOptions",
    "RenderWarning",
]

#: Suffixes :func:`render` understands (the rows of :data:`gradscope.views.formats.FORMATS`).
FORMATS = NAMES


def to_dot(report: ReportLike, *, options: RenderOptions | None = None, **kwargs: Any) -> graphviz.Digraph:
    """The report's graph as a ``graphviz.Digraph`` (deterministic: same model, same source; no layout runs).

    Args:
        report: a :class:`~gradscope.Report`.
        options: a :class:`~gradscope.views.options.RenderOptions`; the keywords below replace its fields.
        collapse: ``None`` (default): the drawing that fits a page (see :mod:`gradscope.views.fit`:
            repeated blocks folded, modules boxed to the depth that fits, the module of every finding
            open down to the finding's node); ``N`` keeps module clusters down to depth ``N`` and draws
            each deeper module as one box; ``False`` expands everything. DOT is made without a layout:
            its default is the most detailed candidate of at most 400 boxes, where the picture formats
            measure the layouts of candidates to pick one.
        show_saved: list saved tensors (shape, dtype, bytes) on op labels; ``None`` (default): unless
            more than ``limit`` elements are drawn (long labels make dot several times slower).
        fold: fold unrolled repetition into ``xN`` boxes; ``None`` (default): when that is needed to fit
            the page; ``True`` always, ``False`` never.
        clusters: draw module clusters; ``None`` (default): when at most ``limit`` elements are drawn.
        legend: add a legend box to the picture.
        limit: the most elements the automatic choice draws; above it labels are shortened and clusters
            left out (dot's layout time grows fast with long labels and clusters).
        rankdir: ``"TB"`` (top to bottom) or ``"LR"`` (left to right); ``None``: TB, or LR when that
            fits the page and TB does not.
        size: the largest size of the picture, ``(width, height)`` in inches (or ``"W,H"``); a bigger
            drawing is scaled down to it (Graphviz ``size``).
        dpi: dots per inch of raster output (.png; Graphviz ``dpi``; default 96).

    Returns:
        ``graphviz.Digraph``; every element has an ``id`` (node id, ``fold:nK``, ``module:NAME``,
        ``unused:NAME``, ``cut:LOCATION``) that ends up in the SVG.

    Raises:
        InputValueError: ``collapse`` is not None, False or a non-negative int; a bad rankdir/size/dpi.
        InputTypeError: an unknown option.

    Example:
        >>> import torch, gradscope
        >>> lin = torch.nn.Linear(3, 1)
        >>> report = gradscope.inspect(lin(torch.randn(2, 3)).sum(), model=lin)
        >>> "AddmmBackward0" in report.to_dot().source
        True
    """
    return drawing(report, options=RenderOptions.of(options, **kwargs), layout=False).dot


def render(
    report: ReportLike,
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    options: RenderOptions | None = None,
    **kwargs: Any,
) -> str:
    """Write the report's graph to ``path``; the format comes from the suffix (or ``format=``).

    Args:
        report: a :class:`~gradscope.Report`.
        path: ``str`` or ``os.PathLike``; suffix ``.svg .png .pdf .html .dot .json .graphml``
            (:data:`gradscope.views.formats.FORMATS`; only .svg .png .pdf .html run a Graphviz layout).
        format: one of :data:`FORMATS`, overriding the suffix.
        options: a :class:`~gradscope.views.options.RenderOptions`; the keywords below replace its fields.
        collapse, show_saved, fold, clusters, legend, limit, rankdir, size, dpi: see :func:`to_dot`.
        max_pixels: a .png whose longer side would pass this many pixels is scaled down to it, with a
            :class:`RenderWarning` (a 10,000 x 30,000 px image helps no one and takes gigabytes to
            open); ``None`` lifts the cap.

    Returns:
        The path written, as a string.

    Raises:
        InputValueError: the format is unknown (the message lists the supported ones).
        InputTypeError: ``path`` is not a str or os.PathLike; an unknown option.
        RenderError: Graphviz ``dot`` is missing or failed (for .svg/.png/.pdf/.html), or the drawing
            has more than :data:`~gradscope.views.fit.MAX_LAYOUT` boxes (refused before any layout,
            saying what works instead).

    Example:
        >>> import torch, gradscope, tempfile, os
        >>> lin = torch.nn.Linear(3, 1)
        >>> report = gradscope.inspect(lin(torch.randn(2, 3)).sum(), model=lin)
        >>> out = report.render(os.path.join(tempfile.mkdtemp(), "graph.dot"))
        >>> out.endswith("graph.dot")
        True
    """
    if not isinstance(path, (str, os.PathLike)):
        raise InputTypeError(
            f"render() needs a file path (str or os.PathLike), got {type(path).__name__} "
            f"{path!r}; for example report.render('graph.svg')."
        )
    path = os.fspath(path)
    if not isinstance(path, str) or "\0" in path:
        raise InputValueError(f"cannot render to {path!r:.80}: a file name must be text without NUL bytes.")
    suffix = os.path.splitext(path)[1]
    fmt = find(format or suffix)
    if fmt is None:
        raise unknown(path, repr(format) if format else (repr(suffix) if suffix else "no suffix"))
    opts = RenderOptions.of(options, **kwargs)
    try:
        data = fmt.write(report, opts, path)
    except TooBigToLayOut as exc:
        raise too_big(fmt.suffix, exc.boxes, exc.fixed, MAX_LAYOUT) from None
    _write(path, data)
    return path


def _write(path: str, data: bytes) -> None:
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as exc:
        raise RenderError(
            f"cannot write {path!r}: {exc.strerror}. Check that the folder exists and is writable."
        ) from None
