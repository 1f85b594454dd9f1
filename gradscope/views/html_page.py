"""The interactive view: the drawings with pan/zoom, search, drill-down, minimap; findings; node details.

:func:`widget` is one self-contained fragment (the notebook display uses it); :func:`page` wraps it in a
full HTML document (``report.render("graph.html")``). No network, no CDN: the script and style come from
``gradscope/views/assets`` and are inlined. The script finds elements by the ``id`` attributes that
:mod:`gradscope.views.dot` puts on every drawn element; a highlighted element gets the class ``gs-hl`` and
the attribute ``data-gs-highlight="1"``, a search match ``gs-match`` (the current one ``gs-cur``). The
controls are documented in docs/viewer.md.
"""

from __future__ import annotations

import html
import itertools
import json
from importlib import resources

from gradscope._format import human_bytes, plural
from gradscope.views.collapse import finding_nodes
from gradscope.views.options import RenderOptions
from gradscope.views.scenes import scenes as _scenes
from gradscope.views.scenes import search_index, svg_text

__all__ = ["page", "widget", "summary_line", "svg_text", "script_json"]

_COUNTER = itertools.count()
_KEYS = (
    "Keys: + / - zoom, 0 fit, arrows pan, / search (Enter, Shift+Enter or arrows step through the "
    "matches), click a violet box to open it, Esc goes back, m toggles the map."
)


def _asset(name: str) -> str:
    return resources.files("gradscope.views").joinpath("assets", name).read_text(encoding="utf-8")


def script_json(data) -> str:
    """``data`` as JSON that is inert inside ``<script>``: no ``<``, ``>`` or ``&`` at all.

    HTML5 leaves a script element's data state on ``</script``, and ``<!--`` followed by ``<script`` puts
    it in the "double escaped" state where even ``</script>`` no longer ends it; a user's parameter name
    can hold any of these. JSON's ``\\u003c`` escapes decode to the same strings.
    """
    text = json.dumps(data, default=str, sort_keys=True, ensure_ascii=False)
    return (
        text.replace("&", "\\u0026")
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def _findings_data(report, top) -> list[dict]:
    return [
        {
            "kind": f.kind,
            "severity": f.severity,
            "message": f.message,
            "location": f.location,
            "params": list(f.params),
            "node": f.node,
            "targets": targets,
            "nodes": finding_nodes(report.graph, f),
        }
        for f, targets in zip(report.findings, top.targets)
    ]


def summary_line(report) -> str:
    """One line: nodes, bytes saved for backward, findings."""
    n = len(report.findings)
    return (
        f'<p class="gs-summary" style="text-align:left"><b>gradscope</b>: '
        f"{report.graph.number_of_nodes()} nodes, {html.escape(human_bytes(report.saved_bytes))} saved for "
        f"backward, {plural(n, 'finding')}</p>"
    )


def _finding_item(i: int, f) -> str:
    where = f' <span class="gs-where">{html.escape(f.location)}</span>' if f.location else ""
    return (
        f'<li class="gs-{html.escape(f.severity)}" data-index="{i}" id="gs-finding-{i}">'
        f'<span class="gs-kind">{html.escape(f.kind)}</span> ({html.escape(f.severity)}){where}<br>'
        f"{html.escape(f.message)}</li>"
    )


def widget(report, all_scenes, *, height: str = "100%", page: bool = False) -> str:
    """The viewer as one HTML fragment: a ``<div class="gs-view">`` with its style, data and script.

    ``all_scenes``: :func:`gradscope.views.scenes.scenes` (the default drawing first). ``height``:
    a CSS height, or ``"auto"`` (the notebook: the pane takes the drawing's height, within limits).
    """
    root = f"gs-view-{next(_COUNTER)}"
    top = all_scenes[0].drawing
    data = {
        "findings": _findings_data(report, top),
        "index": search_index(report, all_scenes),
        "scenes": {
            s.sid: {"title": s.title, "parent": s.parent, "note": s.note, "elements": s.drawing.elements}
            for s in all_scenes
        },
    }
    items = "".join(_finding_item(i, f) for i, f in enumerate(report.findings))
    listing = (
        f'<h4>Findings ({len(report.findings)})</h4><ol class="gs-findings">{items}</ol>'
        if report.findings
        else "<h4>No findings</h4>"
    )
    panel = (
        f'<div class="gs-side">{listing}<h4>Details</h4><div class="gs-details">Hover or click a node.'
        f'</div><div class="gs-keys">{html.escape(_KEYS)}</div></div>'
    )
    bar = (
        '<div class="gs-bar"><input type="search" class="gs-search" aria-label="search" '
        'placeholder="search: op, module, parameter" spellcheck="false"><span class="gs-count"></span>'
        '<button data-act="prev" title="previous match">&lsaquo;</button>'
        '<button data-act="next" title="next match">&rsaquo;</button><span class="gs-crumbs"></span>'
        '<button data-act="in" title="zoom in (+)">+</button>'
        '<button data-act="out" title="zoom out (-)">&minus;</button>'
        '<button data-act="fit" title="fit (0)">fit</button>'
        '<button data-act="map" title="overview map (m)">map</button></div>'
    )
    views = "".join(
        f'<div class="gs-scene" data-scene="{html.escape(s.sid)}"{"" if i == 0 else " hidden"}>{s.svg}</div>'
        for i, s in enumerate(all_scenes)
    )
    mini = (
        '<div class="gs-mini" title="overview: click or drag to move"><svg xmlns="http://www.w3.org/2000/svg">'
        '<use href=""></use><rect class="gs-vp"></rect></svg></div>'
    )
    auto = height == "auto"
    attrs = (
        f'class="gs-view" id="{root}" tabindex="0" data-lm-suppress-shortcuts="true"'
        + (' data-auto-height="1"' if auto else "")
        + (' data-page="1"' if page else "")
        + f' style="height:{"560px" if auto else height}"'
    )
    return (
        f'<div {attrs}><style>{_asset("viewer.css")}</style>{panel}<div class="gs-main">{bar}'
        f'<div class="gs-note"></div><div class="gs-canvas">{views}{mini}</div></div>'
        f'<script type="application/json" class="gs-data">{script_json(data)}</script>'
        f"<script>{_asset('viewer.js').replace('__ROOT__', root)}</script></div>"
    )


def build(report, options: RenderOptions | None = None) -> list:
    """The viewer's scenes for ``report`` (``options``: see :func:`gradscope.views.render.render`)."""
    from gradscope.views.drawing import drawing, pipe

    options = options if options is not None else RenderOptions()
    top = drawing(report, options=options)
    inner = RenderOptions(
        show_saved=options.show_saved, clusters=options.clusters, limit=options.limit, rankdir=options.rankdir
    )
    return _scenes(report, top, lambda box, within: drawing(report, box=box, within=within, options=inner), pipe)


def page(report, options: RenderOptions | None = None) -> str:
    """A complete, self-contained HTML page of ``report`` (see :func:`gradscope.views.render.render`)."""
    title = f"gradscope: {report.graph.number_of_nodes()} nodes, {len(report.findings)} findings"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title>"
        "<style>html,body{margin:0;height:100%}body{padding:8px;box-sizing:border-box}</style></head>"
        f"<body>{widget(report, build(report, options), height='calc(100vh - 16px)', page=True)}"
        "</body></html>\n"
    )
