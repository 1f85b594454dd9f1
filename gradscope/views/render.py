"""Graph views of a report: SVG/PNG/PDF (through Graphviz ``dot``), HTML, DOT, JSON and GraphML.

Legend (the same in every view; see also the README section "Rendering"):

=====================  ============================================================================
element                drawing
=====================  ============================================================================
parameter              light-blue rounded box, blue border: qualified name, shape, dtype
input                  light-green box: a leaf that requires grad but is not a named parameter
op                     rounded box: backward node name, output shape, saved tensors
                       (``slot: shape dtype bytes``, toggle with ``show_saved``); the fill goes from
                       white to orange with its saved bytes (log scale): memory hot spots stand out
root                   an op with a double border, labelled ``root -> shape``
module                 grey rounded cluster around the ops of one module (from ``trace()``, or
                       inferred from the parameters the ops consume)
collapsed module       violet 3-D box: ``NAME (collapsed)``, op count, saved bytes, worst finding
repetition             violet 3-D box ``x200  repeated block``: an unrolled loop folded into one box
shared leaf            small dashed box, ``shared xK``: one stub per use of a leaf used K times
finding                red thick border and a ``!! kind`` line: the hazard node (``inplace-hazard``)
unused parameters      red dashed cluster "no gradient": parameters no path from the root reaches
cut                    red octagon ``CUT: detach`` with its ``file:line`` (needs ``trace()``), linked
                       to the parameters it cut off
=====================  ============================================================================

Edges point in data-flow direction (inputs at the top, the root at the bottom).

Large graphs (more than ``limit`` nodes, 1000 by default) are collapsed automatically: unrolled
repetition is folded into ``xN`` boxes and modules below some depth into one box each; the caption says
so and how to expand (``collapse=False``, or ``collapse=N`` to keep modules down to depth ``N``).
"""

from __future__ import annotations

import json
import os

import graphviz
import networkx as nx

from gradscope.views.collapse import build_view
from gradscope.views.dot import draw
from gradscope.errors import InputTypeError, InputValueError, RenderError

__all__ = ["render", "to_dot", "FORMATS", "AUTO_LIMIT"]

#: Suffixes :func:`render` understands.
FORMATS = ("svg", "png", "pdf", "html", "dot", "json", "graphml")
#: Above this many nodes, the default view collapses.
AUTO_LIMIT = 1000
_DOT_INSTALL = ("the Graphviz 'dot' program is not installed or not on PATH; install it with "
                "'apt-get install graphviz' (Debian/Ubuntu), 'brew install graphviz' (macOS) or "
                "'conda install graphviz', or write a .dot/.json/.graphml file, which needs no Graphviz.")


def _drawing(report, *, collapse=None, show_saved=None, fold=None, clusters=None, legend=False,
             limit=AUTO_LIMIT):
    if collapse is not None and collapse is not False and (
            isinstance(collapse, bool) or not isinstance(collapse, int) or collapse < 0):
        raise InputValueError(f"collapse must be None (automatic), False (expand all) or a module depth "
                              f">= 0, got {collapse!r}.")
    view = build_view(report.graph, report.findings, collapse=collapse, fold=fold, limit=limit)
    return draw(report, view, show_saved=show_saved, clusters=clusters, legend=legend, limit=limit)


def to_dot(report, *, collapse=None, show_saved=None, fold=None, clusters=None,
           legend: bool = False, limit: int = AUTO_LIMIT) -> graphviz.Digraph:
    """The report's graph as a ``graphviz.Digraph`` (deterministic: same model, same source).

    Args:
        report: a :class:`~gradscope.Report`.
        collapse: ``None`` (default) collapses automatically above ``limit`` nodes; ``N`` keeps module
            clusters down to depth ``N`` and draws each deeper module as one box; ``False`` expands all.
        show_saved: list saved tensors (shape, dtype, bytes) on op labels; ``None`` (default): unless
            more than ``limit`` elements are drawn (long labels make dot several times slower).
        fold: fold unrolled repetition into ``xN`` boxes (default: when collapsing automatically).
        clusters: draw module clusters; ``None`` (default): when at most ``limit`` elements are drawn
            (clusters make dot several times slower on big expanded graphs).
        legend: add a legend box to the picture.
        limit: node count above which the default view collapses.

    Returns:
        ``graphviz.Digraph``; every element has an ``id`` (node id, ``fold:nK``, ``module:NAME``,
        ``unused:NAME``, ``cut:LOCATION``) that ends up in the SVG.

    Raises:
        InputValueError: ``collapse`` is not None, False or a non-negative int.

    Example:
        >>> import torch, gradscope
        >>> lin = torch.nn.Linear(3, 1)
        >>> report = gradscope.inspect(lin(torch.randn(2, 3)).sum(), model=lin)
        >>> "AddmmBackward0" in report.to_dot().source
        True
    """
    return _drawing(report, collapse=collapse, show_saved=show_saved, fold=fold, clusters=clusters,
                    legend=legend, limit=limit).dot


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


def render(report, path, *, format: str | None = None, collapse=None, show_saved=None,
           fold=None, clusters=None, legend: bool = False, limit: int = AUTO_LIMIT) -> str:
    """Write the report's graph to ``path``; the format comes from the suffix (or ``format=``).

    Args:
        report: a :class:`~gradscope.Report`.
        path: ``str`` or ``os.PathLike``; suffix ``.svg .png .pdf .html .dot .json .graphml``.
        format: one of :data:`FORMATS`, overriding the suffix.
        collapse, show_saved, fold, clusters, legend, limit: see :func:`to_dot`.

    Returns:
        The path written, as a string.

    Raises:
        InputValueError: the format is unknown (the message lists the supported ones).
        InputTypeError: ``path`` is not a str or os.PathLike.
        RenderError: Graphviz ``dot`` is missing or failed (for .svg/.png/.pdf/.html).

    Example:
        >>> import torch, gradscope, tempfile, os
        >>> lin = torch.nn.Linear(3, 1)
        >>> report = gradscope.inspect(lin(torch.randn(2, 3)).sum(), model=lin)
        >>> out = report.render(os.path.join(tempfile.mkdtemp(), "graph.dot"))
        >>> out.endswith("graph.dot")
        True
    """
    if not isinstance(path, (str, os.PathLike)):
        raise InputTypeError(f"render() needs a file path (str or os.PathLike), got {type(path).__name__} "
                             f"{path!r}; for example report.render('graph.svg').")
    path = os.fspath(path)
    if not isinstance(path, str) or "\0" in path:
        raise InputValueError(f"cannot render to {path!r:.80}: a file name must be text without NUL bytes.")
    fmt = (format or os.path.splitext(path)[1]).lower().lstrip(".")
    if fmt == "gv":
        fmt = "dot"
    if fmt not in FORMATS:
        got = repr(format) if format else (repr(os.path.splitext(path)[1]) if os.path.splitext(path)[1]
                                           else "no suffix")
        raise InputValueError(f"cannot render {path!r}: unknown format {got}. Supported: "
                              f"{', '.join('.' + f for f in FORMATS)} (or pass format='svg').")
    kw = dict(collapse=collapse, show_saved=show_saved, fold=fold, clusters=clusters, legend=legend, limit=limit)
    if fmt == "json":
        from gradscope.views.serialize import report_to_data

        _write(path, json.dumps(report_to_data(report), default=str).encode("utf-8"))
    elif fmt == "graphml":
        buf = "\n".join(nx.generate_graphml(graphml_ready(report.graph))) + "\n"
        _write(path, buf.encode("utf-8"))
    elif fmt == "dot":
        _write(path, to_dot(report, **kw).source.encode("utf-8"))
    elif fmt == "html":
        from gradscope.views.html_page import page

        _write(path, page(report, **kw).encode("utf-8"))
    else:
        _write(path, pipe(to_dot(report, **kw), fmt))
    return path


def _write(path: str, data: bytes) -> None:
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as exc:
        raise RenderError(f"cannot write {path!r}: {exc.strerror}. Check that the folder exists and is "
                          "writable.") from None


def _plain(value):
    """A GraphML-safe value: scalars as is, None dropped, everything else JSON-encoded."""
    if value is None:
        return None
    if isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, default=str, sort_keys=True)


def graphml_ready(graph) -> nx.DiGraph:
    """A copy of ``graph`` whose attributes GraphML can hold (lists/dicts JSON-encoded, None omitted)."""
    out = nx.DiGraph()
    out.graph.update({k: v for k, v in ((k, _plain(v)) for k, v in graph.graph.items()) if v is not None})
    for n, d in graph.nodes(data=True):
        out.add_node(n, **{k: v for k, v in ((k, _plain(v)) for k, v in d.items()) if v is not None})
    for u, v, d in graph.edges(data=True):
        out.add_edge(u, v, **{k: x for k, x in ((k, _plain(x)) for k, x in d.items()) if x is not None})
    return out
