"""The output formats, in one table: suffix -> whether it needs a Graphviz layout, and its writer.

``render()``, the CLI (its ``--format`` choices and the Graphviz check) and docs/pictures.md's table all
read :data:`FORMATS`; a new format is one row here. Text formats never run a layout: ``.dot`` is the
drawing's source, chosen by its box count (see :func:`gradscope.views.fit.unmeasured`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from gradscope.errors import InputValueError, RenderError
from gradscope.views.options import cap_pixels

__all__ = ["Format", "FORMATS", "ALIASES", "NAMES", "LAYOUT", "find", "unknown", "too_big", "graphml_ready"]


@dataclass(frozen=True, slots=True)
class Format:
    """One output format: ``write(report, options, path) -> bytes`` makes the file's content."""

    suffix: str
    needs_layout: bool
    write: Callable[..., bytes]
    what: str


def _json(report, options, path) -> bytes:
    return json.dumps(report.to_json(), default=str).encode("utf-8")


def _graphml(report, options, path) -> bytes:
    import networkx as nx

    return ("\n".join(nx.generate_graphml(graphml_ready(report.graph))) + "\n").encode("utf-8")


def _dot(report, options, path) -> bytes:
    from gradscope.views.drawing import drawing

    return drawing(report, options=options, layout=False).dot.source.encode("utf-8")


def _html(report, options, path) -> bytes:
    from gradscope.views.html_page import page

    return page(report, options).encode("utf-8")


def _picture(fmt: str) -> Callable[..., bytes]:
    def write(report, options, path) -> bytes:
        from gradscope.views.drawing import drawing, pipe

        out = drawing(report, options=options)
        if fmt == "svg" and out.svg is not None:
            return out.svg.encode("utf-8")
        if fmt == "png":
            cap_pixels(out, options, path)
        return pipe(out.dot, fmt)

    return write


_ROWS = (
    Format("svg", True, _picture("svg"), "the picture, vector; opens in a browser"),
    Format("png", True, _picture("png"), "the picture, raster (capped at max_pixels on its longer side)"),
    Format("pdf", True, _picture("pdf"), "the picture, vector, for print"),
    Format("html", True, _html, "the interactive viewer: pan, zoom, search, click a box to open it"),
    Format("dot", False, _dot, "the drawing's Graphviz source (no layout: lay it out with dot yourself)"),
    Format("json", False, _json, "the whole report (networkx node-link); gradscope.load() reads it back"),
    Format("graphml", False, _graphml, "the whole graph for graph tools (lists and dicts JSON-encoded)"),
)
#: suffix -> :class:`Format`, in the order the docs and messages list them.
FORMATS: dict[str, Format] = {f.suffix: f for f in _ROWS}
#: Other suffixes read as a format.
ALIASES = {"gv": "dot"}
#: The suffixes, in order.
NAMES = tuple(FORMATS)
#: The suffixes whose writer runs a Graphviz layout.
LAYOUT = tuple(f.suffix for f in _ROWS if f.needs_layout)


def find(name: str | None) -> Format | None:
    """The format for a suffix or format name (``".SVG"``, ``"gv"``), or None."""
    key = (name or "").lower().lstrip(".")
    return FORMATS.get(ALIASES.get(key, key))


def unknown(path: str, got: str) -> InputValueError:
    """The error for a suffix that is no format."""
    return InputValueError(
        f"cannot render {path!r}: unknown format {got}. Supported: "
        f"{', '.join('.' + f for f in NAMES)} (or pass format='svg')."
    )


def too_big(fmt: str, boxes: int, fixed: bool, limit: int) -> RenderError:
    """The one sentence for a picture refused before its layout: what failed, and what works instead
    (never the format or the option that just failed)."""
    works = []
    if fixed:  # the default drawing folds and boxes; its .html opens each box on click
        works.append("the folded default drawing (without collapse= or --expand)")
        if fmt != "html":
            works.append("its .html, where every box opens on click")
    works.append(".dot, .json or .graphml (no layout needed)")
    return RenderError(
        f"cannot draw {boxes:,} boxes as .{fmt}: Graphviz crashes or runs for hours above {limit:,}, so "
        f"no layout was tried; what works: {'; '.join(works)}."
    )


def _plain(value):
    """A GraphML-safe value: scalars as is, None dropped, everything else JSON-encoded."""
    if value is None:
        return None
    if isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, default=str, sort_keys=True)


def graphml_ready(graph):
    """A copy of ``graph`` whose attributes GraphML can hold (lists/dicts JSON-encoded, None omitted)."""
    import networkx as nx  # here: the CLI reads this table for --help, which should stay quick

    out = nx.DiGraph()
    out.graph.update({k: v for k, v in ((k, _plain(v)) for k, v in graph.graph.items()) if v is not None})
    for n, d in graph.nodes(data=True):
        out.add_node(n, **{k: v for k, v in ((k, _plain(v)) for k, v in d.items()) if v is not None})
    for u, v, d in graph.edges(data=True):
        out.add_edge(u, v, **{k: x for k, x in ((k, _plain(x)) for k, x in d.items()) if x is not None})
    return out
