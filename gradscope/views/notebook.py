"""Jupyter display of a :class:`~gradscope.Report`: the findings table, then the graph with pan and zoom.

Never raises: without Graphviz ``dot`` (or on any rendering failure) the display falls back to the
findings table and a note saying how to get the picture.
"""

from __future__ import annotations

import html

from gradscope.errors import GradscopeError
from gradscope.views.html_page import findings_table, svg_text, widget

__all__ = ["repr_html", "repr_mimebundle"]

_HEIGHT = "520px"


def _render(report):
    from gradscope.views.drawing import draw_report, pipe

    drawing = draw_report(report)
    return drawing, svg_text(pipe(drawing.dot, "svg"))


def repr_html(report) -> str:
    """Findings table on top, then the interactive graph (inline SVG, offline pan/zoom)."""
    table = findings_table(report)
    try:
        drawing, svg = _render(report)
    except GradscopeError as exc:
        return table + f"<p><i>No graph picture: {html.escape(str(exc))}</i></p>"
    except Exception as exc:  # noqa: BLE001 - a notebook display must never raise
        return table + f"<p><i>No graph picture ({html.escape(type(exc).__name__)}: {html.escape(str(exc))}).</i></p>"
    return table + widget(report, drawing, svg, height=_HEIGHT, side=bool(report.findings))


def repr_mimebundle(report, include=None, exclude=None) -> dict:
    """``text/html`` (table + interactive SVG), ``image/svg+xml`` (the bare picture) and ``text/plain``."""
    bundle = {"text/plain": repr(report)}
    wanted = lambda mime: (not include or mime in include) and not (exclude and mime in exclude)  # noqa: E731
    svg = None
    if wanted("text/html") or wanted("image/svg+xml"):
        try:
            drawing, svg = _render(report)
        except Exception:  # noqa: BLE001 - a notebook display must never raise
            drawing = None
        if wanted("text/html"):
            table = findings_table(report)
            if drawing is None or svg is None:
                bundle["text/html"] = table + ("<p><i>No graph picture: Graphviz 'dot' is missing or failed "
                                               "(apt-get install graphviz).</i></p>")
            else:
                bundle["text/html"] = table + widget(report, drawing, svg, height=_HEIGHT,
                                                     side=bool(report.findings))
        if wanted("image/svg+xml") and svg is not None:
            bundle["image/svg+xml"] = svg
    return {k: v for k, v in bundle.items() if wanted(k)}
