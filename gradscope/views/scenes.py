"""The drawings the HTML viewer navigates: the default drawing, plus one pre-rendered drawing per box.

A *scene* is one SVG. Scene ``"top"`` is the drawing :func:`gradscope.views.render.render` writes; every
box in it (a folded ``xN`` block, a collapsed module) that has a scene of its own opens on click, and so on
down (the viewer's breadcrumbs lead back). Everything is laid out here, in Python, once: the page needs no
Python and no network to open a box. See NOTE [scene budget].

:func:`search_index` lists every graph node (op, parameter, input) with the chain of boxes that holds it
in each scene, so a search finds a node wherever it is drawn.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gradscope.views.dot import Drawing

__all__ = ["Scene", "scenes", "search_index", "svg_text"]

# NOTE [scene budget]
# Each box's scene costs one `dot` run and its SVG travels in the page. A 12-layer GPT-2 has a dozen boxes
# (fast); a 96-layer transformer has a hundred layer boxes. We lay scenes out breadth-first (the boxes a user
# meets first come first) until MAX_SCENES scenes, MAX_BYTES of SVG or MAX_SECONDS of layout are spent; a box
# beyond that says so in its details (and how to see it: render(..., collapse=N)). A folded block of more
# than FOLD_NODES nodes draws only its first repetitions (the rest repeat the same ops; the note says which).
MAX_SCENES = 150
MAX_BYTES = 12_000_000
MAX_SECONDS = 20.0
FOLD_NODES = 400
GROUP_KINDS = ("fold", "module")
_COMMENT = re.compile(r"<!--.*?-->", re.S)


@dataclass(slots=True)
class Scene:
    """One drawing of the viewer: its SVG text, its elements' details, where it sits in the box tree."""

    sid: str  # "top" or the id of the box it expands ("fold:n12", "module:enc")
    title: str
    parent: str | None
    svg: str
    drawing: Drawing
    nodes: list = field(default_factory=list)  # graph nodes inside this scene
    note: str | None = None


def svg_text(svg_bytes: bytes) -> str:
    """The ``<svg>`` element of dot's SVG output (XML prolog, doctype and comments dropped)."""
    text = svg_bytes.decode("utf-8")
    return _COMMENT.sub("", text[text.index("<svg") :])


def _boxes(drawing) -> dict:
    """Box element id -> graph nodes drawn inside it."""
    out: dict = {}
    for n, eid in drawing.element_of.items():
        if (drawing.elements.get(eid) or {}).get("kind") in GROUP_KINDS:
            out.setdefault(eid, []).append(n)
    return out


def _svg(drawing, pipe) -> str:
    return svg_text(drawing.svg.encode("utf-8") if drawing.svg else pipe(drawing.dot, "svg"))


def _title(info: dict) -> str:
    if info.get("kind") == "fold":
        return f"{info.get('name')} {info.get('module') or ''}".strip()
    return str(info.get("name"))


def scenes(report, top, open_box, pipe, *, budget=(MAX_SCENES, MAX_BYTES, MAX_SECONDS)) -> list:
    """Every scene of ``report``, ``top`` (the default :class:`Drawing`) first; see NOTE [scene budget].

    ``open_box(box, within) -> Drawing`` draws one box opened (:func:`gradscope.views.render.drawing`);
    ``pipe(digraph, "svg") -> bytes`` runs Graphviz when a drawing has no SVG yet. A box whose scene did
    not fit the budget gets ``info["closed"]``, the sentence the viewer shows for it.
    """
    max_scenes, max_bytes, max_seconds = budget
    start = time.monotonic()
    out = [Scene("top", "model", None, _svg(top, pipe), top, list(report.graph.nodes))]
    seen = {"top"}
    spent = len(out[0].svg)
    i = 0
    while i < len(out):
        parent = out[i]
        i += 1
        for box, members in _boxes(parent.drawing).items():
            info = parent.drawing.elements[box]
            if box in seen:
                continue
            if len(out) >= max_scenes or spent >= max_bytes or time.monotonic() - start > max_seconds:
                info["closed"] = (
                    "Not pre-rendered (the page's size budget is spent): draw it with "
                    "render(path, collapse=N) or collapse=False."
                )
                continue
            drawing = open_box(box, parent.drawing)
            svg = _svg(drawing, pipe)
            spent += len(svg)
            seen.add(box)
            note = None
            if info.get("kind") == "fold" and (info.get("reps") or 1) > 1:
                note = (
                    f"One repetition of {info.get('name')} drawn: every repetition runs the same ops "
                    f"(render(path, collapse=False) draws them all)."
                )
            out.append(Scene(box, _title(info), parent.sid, svg, drawing, members, note))
    return out


_CONTEXT = re.compile(r'<g id="([^"]+)" class="[^"]*\bgs-context\b')


def search_index(report, all_scenes: list) -> dict:
    """What the search box searches: ``names`` (a string table), ``paths`` (box chains) and ``nodes``.

    ``nodes`` rows are ``[node id, name, module, path, drawn]`` (name/module/path: indices into the
    tables). ``path`` lists the boxes that hold the node, outermost first (``[]``: in the top drawing);
    ``drawn`` is 1 when the node itself is drawn in the scene of the last box, 0 when the last box is as
    deep as it goes (its scene was not pre-rendered, or it shows only the first repetitions).
    """
    graph = report.graph
    by_sid = {s.sid: s for s in all_scenes}
    inside = {s.sid: (None if s.parent is None else set(s.nodes)) for s in all_scenes}
    stubs = {s.sid: set(_CONTEXT.findall(s.svg)) for s in all_scenes}
    view = by_sid["top"].drawing.view
    module_of = view.module_of if view is not None else {}
    names: dict = {}
    paths: dict = {(): 0}
    rows = []

    def name(x):
        return names.setdefault("" if x is None else str(x), len(names))

    for n, d in graph.nodes(data=True):
        chain: list = []
        scene = by_sid["top"]
        drawn = 0
        while True:
            sid = scene.sid
            eid = scene.drawing.element_of.get(n)
            members = inside[sid]
            if eid is None or eid in stubs[sid] or (members is not None and n not in members):
                break
            if eid in by_sid and eid != sid:
                chain.append(eid)
                scene = by_sid[eid]
                continue
            if (scene.drawing.elements.get(eid) or {}).get("kind") in GROUP_KINDS:
                chain.append(eid)
            else:
                drawn = 1
            break
        rows.append(
            [
                n,
                name(d["name"]),
                name(module_of.get(n) or d.get("module")),
                paths.setdefault(tuple(chain), len(paths)),
                drawn,
            ]
        )
    for eid, info in by_sid["top"].drawing.elements.items():  # parameters no gradient reaches
        if info.get("kind") == "unused":
            for p in info.get("params") or ():
                rows.append([eid, name(p), name(p.rpartition(".")[0]), 0, 1])
    return {"names": list(names), "paths": [list(p) for p in paths], "nodes": rows}
