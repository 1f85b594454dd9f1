"""The drawing every graph view shows: the layout chosen to fit a page (:mod:`gradscope.views.fit`), or
one box of it opened, and the one call that runs Graphviz (:func:`pipe`). ``render``, the HTML page and
the notebook all come here, so no view calls another's private helpers."""

from __future__ import annotations

import shutil

import graphviz

from gradscope._format import one_line
from gradscope.errors import InputValueError, RenderError
from gradscope.views.boxes import box_part, unmeasured
from gradscope.views.options import check, scale

__all__ = ["drawing", "pipe", "AUTO_LIMIT"]

#: The most elements the default drawing has (beyond it: short labels, no clusters).
AUTO_LIMIT = 1000
_DOT_INSTALL = (
    "the Graphviz 'dot' program is not installed or not on PATH; install it with "
    "'apt-get install graphviz' (Debian/Ubuntu), 'brew install graphviz' (macOS) or "
    "'conda install graphviz', or write a .dot/.json/.graphml file, which needs no Graphviz."
)


def _laid_out(
    report,
    *,
    collapse=None,
    show_saved=None,
    fold=None,
    clusters=None,
    legend=False,
    limit=AUTO_LIMIT,
    rankdir=None,
    size=None,
    dpi=None,
    box=None,
    within=None,
    layout=True,
):
    """The :class:`~gradscope.views.dot.Drawing` to show (laid out when ``layout`` and dot is installed)."""
    from gradscope.views.fit import choose

    check(collapse, rankdir, size, dpi, None)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InputValueError(f"limit must be a positive int (a node count), got {one_line(limit)}.")
    rankdir = rankdir.upper() if rankdir else None
    module_of = None
    if box is not None:
        if within is None:
            within = _laid_out(report, limit=limit, legend=False, layout=layout)
        report, module_of, collapse, fold = box_part(report, box, within, collapse, fold)
    kw = dict(show_saved=show_saved, clusters=clusters, legend=legend)
    if not layout or shutil.which("dot") is None:
        return unmeasured(report, collapse, fold, limit, rankdir or "TB", module_of, size, dpi, kw)
    out = choose(
        report, pipe=pipe, fold=fold, collapse=collapse, rankdir=rankdir, limit=limit, module_of=module_of, **kw
    )
    if size is not None or dpi is not None:
        scale(out, size, dpi)
        out.svg = pipe(out.dot, "svg").decode("utf-8")
        from gradscope.views.fit import svg_size

        out.size = svg_size(out.svg)
    return out


def drawing(
    report,
    *,
    box: str | None = None,
    within=None,
    collapse=None,
    fold=None,
    show_saved=None,
    clusters=None,
    legend: bool = False,
    limit: int = AUTO_LIMIT,
    rankdir: str | None = None,
    size=None,
    dpi=None,
    layout: bool = True,
):
    """The laid-out drawing of ``report`` (the default one), or of one box of a drawing opened.

    This is the stable entry point of views that navigate a picture (the HTML page, the notebook).

    Args:
        report: a :class:`~gradscope.Report`.
        box: ``None`` for the whole graph; else the id of a box (a folded block ``"fold:nK"`` or a
            collapsed module ``"module:NAME"``) drawn in ``within``: the result draws what is inside it,
            chosen to fit a page again (a fold shows its first repetition: every repetition runs the
            same ops). ``"module:NAME"`` also works for any module that is not boxed. The ops just
            outside the box are drawn as small dashed stubs (class ``gs-context``) so the edges in
            and out stay visible.
        within: the :class:`~gradscope.views.dot.Drawing` that holds ``box`` (default: the default
            drawing of ``report``; pass it when you have it, it saves a layout; for a box inside an
            opened box, pass the opened box's drawing).
        collapse, fold, show_saved, clusters, legend, limit, rankdir, size, dpi: see :func:`to_dot`.

    Returns:
        :class:`~gradscope.views.dot.Drawing` with
        ``svg`` (dot's SVG document, ``None`` when Graphviz is not installed), ``size`` ((width, height)
        in pt), ``dot`` (the ``graphviz.Digraph``), ``view`` (the plan: ``view.groups`` maps every box id
        to its :class:`~gradscope.views.collapse.Group`), ``element_of`` (graph node id -> the id of the
        element it is drawn in or as), ``targets`` (per finding, in ``report.findings`` order, the element
        ids to highlight) and ``elements``: element id -> metadata, the same ids as the SVG's ``<g id>``.
        Every element has ``kind`` ("op", "param", "input", "fold", "module", "unused", "cut"), ``name``,
        ``module``, ``params`` (parameter names), ``bytes`` (human-readable activations held); ops also
        ``node``, ``op``, ``held`` / ``by_reference`` (bytes), ``saved`` (slot lines), ``context`` (a stub
        outside the opened box); boxes also ``group``
        (their id), ``expandable`` (True), ``ops``, ``members``, ``reps``, ``pattern``, ``op_names``,
        ``worst`` (message of the worst finding inside). SVG classes: ``gs-op gs-param gs-input gs-root
        gs-group gs-fold gs-module gs-unused gs-cut gs-stub gs-context gs-finding``.

    Raises:
        InputValueError: ``box`` is not a box of ``within``; a bad option value.
        RenderError: Graphviz ``dot`` failed.

    Example:
        >>> import torch, gradscope
        >>> from gradscope.views.render import drawing
        >>> lin = torch.nn.Linear(3, 1)
        >>> report = gradscope.inspect(lin(torch.randn(2, 3)).sum(), model=lin)
        >>> d = drawing(report)
        >>> weight = next(n for n, name in report.graph.nodes(data="name") if name == "weight")
        >>> d.elements[d.element_of[weight]]["params"]
        ['weight']
    """
    return _laid_out(
        report,
        box=box,
        within=within,
        collapse=collapse,
        fold=fold,
        show_saved=show_saved,
        clusters=clusters,
        legend=legend,
        limit=limit,
        rankdir=rankdir,
        size=size,
        dpi=dpi,
        layout=layout,
    )


def pipe(dot: graphviz.Digraph, fmt: str) -> bytes:
    """Run ``dot`` on ``dot`` and return the ``fmt`` output; :class:`RenderError` when it cannot."""
    try:
        return dot.pipe(format=fmt, quiet=True)
    except graphviz.ExecutableNotFound:
        raise RenderError(_DOT_INSTALL) from None
    except graphviz.CalledProcessError as exc:
        err = (exc.stderr or b"").decode("utf-8", "replace").strip().splitlines()
        raise RenderError(
            f"Graphviz 'dot' failed to lay out the graph ({err[-1] if err else exc}); "
            "write a .dot file instead, or render with a smaller collapse=N."
        ) from None
