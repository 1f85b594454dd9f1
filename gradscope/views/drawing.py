"""The graphviz drawing of a report, shared by every picture (``render``, ``html_page``, ``notebook``),
and running ``dot`` on it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import graphviz

from gradscope.errors import InputValueError, RenderError
from gradscope.views.collapse import build_view
from gradscope.views.dot import Drawing, draw

if TYPE_CHECKING:
    from gradscope.report import Report

__all__ = ["AUTO_LIMIT", "draw_report", "pipe"]

#: Above this many nodes, the default view collapses.
AUTO_LIMIT = 1000
_DOT_INSTALL = ("the Graphviz 'dot' program is not installed or not on PATH; install it with "
                "'apt-get install graphviz' (Debian/Ubuntu), 'brew install graphviz' (macOS) or "
                "'conda install graphviz', or write a .dot/.json/.graphml file, which needs no Graphviz.")


def draw_report(report: Report, *, collapse=None, show_saved=None, fold=None, clusters=None, legend=False,
                limit=AUTO_LIMIT) -> Drawing:
    """Plan and draw ``report``: the :class:`~gradscope.views.dot.Drawing` (its ``.dot`` plus the element
    data the HTML viewer needs). Arguments as in :func:`gradscope.views.render.to_dot`.

    Raises:
        InputValueError: ``collapse`` is not None, False or a non-negative int.
    """
    if collapse is not None and collapse is not False and (
            isinstance(collapse, bool) or not isinstance(collapse, int) or collapse < 0):
        raise InputValueError(f"collapse must be None (automatic), False (expand all) or a module depth "
                              f">= 0, got {collapse!r}.")
    view = build_view(report.graph, report.findings, collapse=collapse, fold=fold, limit=limit)
    return draw(report, view, show_saved=show_saved, clusters=clusters, legend=legend, limit=limit)


def pipe(dot: graphviz.Digraph, fmt: str) -> bytes:
    """Run ``dot`` on ``dot`` and return the ``fmt`` output; :class:`RenderError` when it cannot."""
    try:
        return dot.pipe(format=fmt, quiet=True)
    except graphviz.ExecutableNotFound:
        raise RenderError(_DOT_INSTALL) from None
    except graphviz.CalledProcessError as exc:
        err = (exc.stderr or b"").decode("utf-8", "replace").strip().splitlines()
        raise RenderError(f"Graphviz 'dot' failed to lay out the graph ({err[-1] if err else exc}); "
                          "write a .dot file instead, or render with a smaller collapse=N.") from None
