"""The drawing every graph view shows: the layout chosen to fit a page (:mod:`gradscope.views.fit`), or
one box of it opened, and the one call that runs Graphviz (:func:`pipe`). ``render``, the HTML page and
the notebook all come here, so no view calls another's private helpers."""

from __future__ import annotations

import shutil
from typing import Any

import graphviz

from gradscope.errors import RenderError
from gradscope.views.boxes import box_part
from gradscope.views.options import AUTO_LIMIT, RenderOptions, scale

__all__ = ["drawing", "pipe", "AUTO_LIMIT"]

_DOT_INSTALL = (
    "the Graphviz 'dot' program is not installed or not on PATH; install it with "
    "'apt-get install graphviz' (Debian/Ubuntu), 'brew install graphviz' (macOS) or "
    "'conda install graphviz', or write a .dot/.json/.graphml file, which needs no Graphviz."
)


def _laid_out(report, options: RenderOptions, box=None, within=None, layout=True):
    """The :class:`~gradscope.views.dot.Drawing` to show (laid out when ``layout`` and dot is installed)."""
    from gradscope.views.fit import choose, refuse_expanded, svg_size, unmeasured
    from gradscope.views.regions import with_regions

    report = with_regions(report)  # NOTE [compiled regions in the picture]
    if layout and box is None:
        refuse_expanded(report, options)
    module_of = None
    if box is not None:
        if within is None:
            within = _laid_out(report, RenderOptions(limit=options.limit), layout=layout)
        report, module_of, collapse, fold = box_part(report, box, within, options.collapse, options.fold)
        options = options.replace(collapse=collapse, fold=fold)
    if not layout or shutil.which("dot") is None:
        return unmeasured(report, options, module_of)
    out = choose(report, options, pipe=pipe, module_of=module_of)
    if options.size is not None or options.dpi is not None:
        scale(out, options)
        out.svg = pipe(out.dot, "svg").decode("utf-8")
        out.size = svg_size(out.svg)
    return out


def drawing(
    report,
    *,
    box: str | None = None,
    within=None,
    layout: bool = True,
    options: RenderOptions | None = None,
    **kwargs: Any,
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
        layout: ``False``: never run Graphviz (``svg`` and ``size`` stay ``None``; the default drawing
            is then chosen by its box count, not measured).
        options: a :class:`~gradscope.views.options.RenderOptions`; ``kwargs`` (``collapse``, ``fold``,
            ``show_saved``, ``clusters``, ``legend``, ``limit``, ``rankdir``, ``size``, ``dpi``: see
            :func:`to_dot`) replace its fields.

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
        InputTypeError: an unknown option.
        RenderError: Graphviz ``dot`` failed, or the drawing has more boxes than a layout manages
            (:class:`~gradscope.views.fit.TooBigToLayOut`, raised before any layout).

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
    return _laid_out(report, RenderOptions.of(options, **kwargs), box, within, layout)


def pipe(dot: graphviz.Digraph, fmt: str, timeout: float | None = None) -> bytes:
    """Run Graphviz (``dot.engine``, ``dot`` by default) on ``dot`` and return the ``fmt`` output, stopped
    after ``timeout`` seconds (:class:`~gradscope.views.layout.LayoutTimeout`); :class:`RenderError` when
    it cannot."""
    from gradscope.views.layout import run

    try:
        return run(dot, fmt, timeout)
    except graphviz.ExecutableNotFound:
        raise RenderError(_DOT_INSTALL) from None
    except OSError as exc:  # dot died before reading its input (a broken pipe)
        raise RenderError(f"Graphviz 'dot' could not be run ({exc}); write .dot, .json or .graphml instead.") from None
