"""Jupyter display of a :class:`~gradscope.Report`: one line of totals, then the viewer.

The viewer (:mod:`gradscope.views.html_page`) holds the one list of findings, linked to the graph, and
the graph pane with the page's search, drill-down, minimap and keys; the pane takes the drawing's height.
Never raises: without Graphviz ``dot`` (or on any rendering failure) the display falls back to the
findings as a list and a note saying how to get the picture.
"""

from __future__ import annotations

import html

from gradscope.errors import GradscopeError
from gradscope.views.html_page import build, summary_line, widget

__all__ = ["repr_html", "repr_mimebundle", "findings_list"]


def findings_list(report) -> str:
    """The totals line and the findings as a plain, left-aligned HTML list (the view without a graph)."""
    items = "".join(
        f'<li style="text-align:left;margin:0 0 6px"><code>{html.escape(f.kind)}</code> '
        f"({html.escape(f.severity)}){' at ' + html.escape(f.location) if f.location else ''}<br>"
        f"{html.escape(f.message)}</li>"
        for f in report.findings
    )
    return summary_line(report) + (f'<ol class="gs-plain" style="text-align:left">{items}</ol>' if items else "")


def _view(report) -> tuple[str, str | None]:
    """(text/html, the bare SVG or None): the viewer, or the list and why there is no picture."""
    try:
        all_scenes = build(report)
    except GradscopeError as exc:
        return findings_list(report) + f"<p><i>No graph picture: {html.escape(str(exc))}</i></p>", None
    except Exception as exc:  # noqa: BLE001 - a notebook display must never raise
        return (
            findings_list(report) + f"<p><i>No graph picture ({html.escape(type(exc).__name__)}: "
            f"{html.escape(str(exc))}).</i></p>"
        ), None
    return summary_line(report) + widget(report, all_scenes, height="auto"), all_scenes[0].svg


def repr_html(report) -> str:
    """Totals line, then the interactive viewer (inline SVG, offline pan/zoom/search/drill-down)."""
    return _view(report)[0]


def repr_mimebundle(report, include=None, exclude=None) -> dict:
    """``text/html`` (the viewer), ``image/svg+xml`` (the bare default picture) and ``text/plain``."""
    wanted = lambda mime: (not include or mime in include) and not (exclude and mime in exclude)  # noqa: E731
    bundle = {"text/plain": repr(report)}
    if wanted("text/html") or wanted("image/svg+xml"):
        text, svg = _view(report)
        bundle["text/html"] = text
        if svg is not None:
            bundle["image/svg+xml"] = svg
    return {k: v for k, v in bundle.items() if wanted(k)}
