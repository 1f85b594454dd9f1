"""The default drawing: chosen from the graph and measured on its layout, so that it is legible.

See NOTE [fitting a page]. :func:`legible` is the rule, :func:`choose` the search, :func:`svg_size` reads
a laid-out drawing's size.
"""

from __future__ import annotations

import re

from gradscope._format import plural
from gradscope.errors import RenderError
from gradscope.views.collapse import MIN_OPS, MIN_REPS, build_view, depth, infer_modules
from gradscope.views.dot import FINDING_FONT, draw
from gradscope.views.layout import MAX_COST, Budget, LayoutTimeout, estimate, robust
from gradscope.views.options import scale
from gradscope.views.wrap import columns_for

__all__ = [
    "PAGE_PT",
    "MAX_ASPECT",
    "WINDOW_PX",
    "MIN_TEXT_PX",
    "MAX_LAYOUT",
    "TooBigToLayOut",
    "refuse_expanded",
    "legible",
    "svg_size",
    "choose",
    "unmeasured",
    "draw_with",
    "elements",
    "caption_note",
]

# NOTE [fitting a page]
# The default drawing is the most detailed one that passes `legible` on its actual dot layout: at most
# PAGE_PT on its longer side, an aspect ratio of at most MAX_ASPECT, and the text of every finding at
# least MIN_TEXT_PX tall when the page is fit to a WINDOW_PX wide window (SVG pt are 4/3 px). Candidates,
# most detailed first: everything expanded; repetition folded ("xN") with modules kept down to the
# deepest depth, then one level shallower at a time; then looser folding (x2 and up) the same way. A
# candidate with more than `limit` drawn elements (or PAGE_ELEMENTS, when smaller) cannot pass and is
# skipped without a layout. Each candidate is laid out TB, and LR when TB came out too wide (unless the
# caller fixed rankdir); a TB layout within the page's side but too tall for its width is also tried
# wrapped into columns (NOTE [wrapping columns]). The module holding a finding is never boxed and a
# finding's node never folded (collapse.build_view), so whatever is chosen shows every finding's node
# with its label. When nothing passes, the smallest candidate is drawn and its caption says so.

PAGE_PT = 3000
MAX_ASPECT = 4.0
WINDOW_PX = 1600
MIN_TEXT_PX = 10
PAGE_ELEMENTS = 400
# NOTE [layout limit]: Graphviz 2.43's dot crashes (glibc "malloc(): invalid size") on an expanded chain of
# 35,000 ops and lays out 30,000 in 4 s; a graph with many joins is slower (an expanded diamond stack: 5,000
# ops in 29 s, 10,000 over 4 minutes). Above MAX_LAYOUT boxes no layout is tried: the picture formats fail
# at once with what works instead (docs/pictures.md, "Big graphs").
MAX_LAYOUT = 25_000
#: Seconds the last layout of a search that found no legible drawing may take (its caption changed).
SETTLE_SECONDS = 20.0
_LOOSE = (2, 8)
CHAIN = 3
_SIZE = re.compile(rb'<svg width="([\d.]+)pt" height="([\d.]+)pt"')


def svg_size(svg: bytes | str) -> tuple[float, float]:
    """``(width, height)`` in pt of an SVG written by dot."""
    data = svg.encode() if isinstance(svg, str) else svg
    m = _SIZE.search(data)
    if not m:
        raise ValueError("not an SVG written by Graphviz dot (no width=...pt height=...pt)")
    return float(m.group(1)), float(m.group(2))


def text_px(width_pt: float, font_pt: float = FINDING_FONT) -> float:
    """How tall ``font_pt`` text is on a ``width_pt`` wide drawing fit to a :data:`WINDOW_PX` window."""
    scale = min(1.0, WINDOW_PX / (width_pt * 4 / 3))
    return font_pt * 4 / 3 * scale


def legible(width: float, height: float, font_pt: float = FINDING_FONT) -> str | None:
    """``None`` when a ``width x height`` pt drawing follows NOTE [fitting a page], else the reason."""
    if max(width, height) > PAGE_PT:
        return f"{width:.0f} x {height:.0f} pt: longer side over {PAGE_PT} pt"
    if max(width, height) > MAX_ASPECT * max(min(width, height), 1.0):
        return f"{width:.0f} x {height:.0f} pt: aspect ratio over {MAX_ASPECT:g}:1"
    if text_px(width, font_pt) < MIN_TEXT_PX:
        return f"{width:.0f} pt wide: text under {MIN_TEXT_PX} px in a {WINDOW_PX} px window"
    return None


def _elements(graph, view) -> int:
    return graph.number_of_nodes() - len(view.owner) + len(view.groups)


def candidates(graph, findings, *, fold, collapse, module_of, cache):
    """Views to try, most detailed first (see NOTE [fitting a page])."""
    # (fold thresholds (min_reps, min_ops) or None, collapse depth, chain length or None, runs of calls)
    stages: list[tuple[tuple[int, int] | None, int | None, int | None, bool]]
    if collapse is not None:
        stages = [((MIN_REPS, MIN_OPS) if fold else None, None if collapse is False else collapse, None, False)]
    else:
        deepest = max((depth(m) for m in module_of.values()), default=0)
        depths = [None] + list(range(deepest - 1, -1, -1))
        folds = {None: [(MIN_REPS, MIN_OPS), _LOOSE], True: [(MIN_REPS, MIN_OPS), _LOOSE]}.get(fold, [None])
        stages = [(None, None, None, False)] if fold is None else []
        stages += [(f, d, None, False) for f in folds for d in depths]
        stages += [(folds[-1], d, None, True) for d in depths[1:]]
        stages += [(folds[-1], d, CHAIN, True) for d in depths]
    seen = set()
    for f, d, chains, spans in stages:
        view = build_view(
            graph,
            findings,
            collapse=d,
            fold=f is not None,
            min_reps=(f or _LOOSE)[0],
            min_ops=(f or _LOOSE)[1],
            module_of=module_of,
            cache=cache,
            chains=chains,
            spans=spans,
        )
        key = (frozenset(view.owner.items()), d)
        if key not in seen:
            seen.add(key)
            yield view


def elements(graph, view) -> int:
    """How many boxes ``view`` draws (ops, leaves and groups; before shared-leaf stubs)."""
    return _elements(graph, view)


class TooBigToLayOut(RenderError):
    """A drawing with more boxes than :data:`MAX_LAYOUT`: refused before Graphviz runs."""

    def __init__(self, boxes: int, fixed: bool):
        self.boxes, self.fixed = boxes, fixed
        super().__init__(
            f"{boxes:,} boxes are more than a Graphviz layout manages ({MAX_LAYOUT:,}; above it dot crashes "
            "or runs for hours), so no picture was drawn: write .dot, .json or .graphml, which need no layout."
        )


def refuse_expanded(report, options) -> None:
    """Refuse an expanded drawing over :data:`MAX_LAYOUT` from the node count alone, before anything
    else is computed (every node is drawn, so the count is a lower bound on its boxes)."""
    if options.collapse is False and not options.fold:
        peek = getattr(report, "peek_graph", None)
        nodes = len(peek() if peek is not None else report.graph)
        if nodes > MAX_LAYOUT:
            raise TooBigToLayOut(nodes, True)


def _guard(graph, view, fixed: bool) -> None:
    boxes = _elements(graph, view)
    if boxes > MAX_LAYOUT:
        raise TooBigToLayOut(boxes, fixed)


def _lay_out(report, view, options, direction, pipe, columns: int = 1, timeout=None):
    """``view`` drawn and laid out (NOTE [dot crashes]: retried without what makes Graphviz crash)."""

    def draw(**changes):
        return draw_with(report, view, options, direction, columns, **changes)

    drawing, svg, _ = robust(draw, pipe, timeout)
    drawing.svg = svg.decode("utf-8")
    drawing.size = svg_size(drawing.svg)
    return drawing


def _wrapped(report, view, options, pipe, w: float, h: float, budget):
    """A TB drawing within the page but too tall for its width, wrapped into columns (NOTE [wrapping
    columns]); ``None`` when no wrapping passes :func:`legible`."""
    if max(w, h) > PAGE_PT or h <= MAX_ASPECT * w:
        return None
    note = view.note
    for k in dict.fromkeys((columns_for(w, h), columns_for(w, h) + 1)):
        if not budget.can_run():
            break
        view.note = (note + " " if note else "") + f"Wrapped into {k} columns: read each top to bottom."
        budget.used += 1
        drawing = _lay_out(report, view, options, "TB", pipe, k, budget.left())
        if legible(*drawing.size) is None:
            return drawing
    view.note = note
    return None


def draw_with(report, view, options, rankdir, columns: int = 1, **changes):
    """:func:`~gradscope.views.dot.draw` of ``view`` with ``options`` (no layout); ``changes``: ``clusters``,
    ``safe``, ``dropped`` for a retry after a Graphviz crash."""
    return draw(
        report,
        view,
        show_saved=options.show_saved,
        clusters=changes.get("clusters", options.clusters),
        legend=options.legend,
        limit=options.limit,
        rankdir=rankdir,
        columns=columns,
        safe=changes.get("safe", False),
        dropped=changes.get("dropped"),
    )


def choose(report, options, *, pipe, module_of=None, budget=None):
    """The drawing to show: laid out, with ``.svg`` and ``.size`` set (see NOTE [fitting a page] and NOTE
    [layout budget]).

    ``options.collapse`` given explicitly fixes the view (no search, no time limit); ``options.rankdir``
    given fixes the direction. ``pipe(dot, "svg", timeout)`` runs Graphviz; ``budget`` (a
    :class:`~gradscope.views.layout.Budget`) bounds the search.

    Raises:
        TooBigToLayOut: the drawing to lay out has more than :data:`MAX_LAYOUT` boxes (before any layout).
    """
    graph = report.graph
    module_of = infer_modules(graph) if module_of is None else module_of
    views = candidates(
        graph, report.findings, fold=options.fold, collapse=options.collapse, module_of=module_of, cache={}
    )
    if options.collapse is not None:
        view = next(iter(views))
        _guard(graph, view, True)
        return _lay_out(report, view, options, options.rankdir or "TB", pipe)
    budget = Budget() if budget is None else budget
    found, best, passed = _search(report, options, views, pipe, budget)
    return found if found is not None else _settle(report, options, best, passed + list(views), pipe, budget)


def _search(report, options, views, pipe, budget):
    """Lay candidates out until one passes :func:`legible`: ``(that drawing or None, the smallest layout
    seen as (longer side, drawing, direction) or None, the views passed over)``."""
    graph = report.graph
    directions = [options.rankdir] if options.rankdir else ["TB", "LR"]
    limit = min(options.limit, PAGE_ELEMENTS)
    best = None  # (longer side, drawing, direction) of the smallest layout seen
    passed = []
    for view in views:
        boxes = _elements(graph, view)
        passed.append(view)
        if boxes > limit:
            continue
        est = estimate(graph, view, boxes)
        dirs = [d for d in directions if est.fits(d, PAGE_PT)]
        if not dirs or est.cost > MAX_COST:  # cannot fit a page, or too slow to lay out: no layout
            continue
        _guard(graph, view, False)
        if view.groups or view.depth is not None:
            view.note = caption_note(graph, view)
        for direction in dirs:
            if not budget.can_run():
                budget.spent = True
                return None, best, passed
            budget.used += 1
            try:
                drawing = _lay_out(report, view, options, direction, pipe, timeout=budget.left())
            except LayoutTimeout:
                budget.spent = True
                return None, best, passed
            w, h = drawing.size
            if legible(w, h) is None:
                return drawing, best, passed
            if best is None or max(w, h) < best[0]:
                best = (max(w, h), drawing, direction)
            if direction == "TB" and not options.rankdir:
                wrapped = _wrapped(report, view, options, pipe, w, h, budget)
                if wrapped is not None:
                    return wrapped, best, passed
            if h >= w:  # LR swaps the sides: a drawing too tall in TB is too wide in LR
                break
    return None, best, passed


def _settle(report, options, best, passed, pipe, budget):
    """When no candidate passed :func:`legible`: the smallest layout seen (or, when none was laid out, the
    candidate of fewest boxes), with a caption that says why."""
    graph = report.graph
    if best is not None:
        view, direction = best[1].view, best[2]
    else:
        view, direction = min(passed, key=lambda v: _elements(graph, v)), options.rankdir or "TB"
        _guard(graph, view, False)
    why = (
        f" The layout budget ({budget.seconds:g} s, at most {plural(budget.layouts, 'layout')}) was spent after "
        f"{plural(budget.used, 'layout')}: this is the best drawing found so far; render(path, collapse=N) "
        "draws one depth without the search, or open the .html view."
        if budget.spent
        else " No drawing of this graph fits one page: zoom in, or open the .html view."
    )
    view.note = (caption_note(graph, view) if view.groups else "") + why
    try:  # the caption changed: lay it out again, in about the time it took before
        return _lay_out(report, view, options, direction, pipe, timeout=SETTLE_SECONDS if budget.spent else None)
    except LayoutTimeout:
        if best is None:
            raise
        return best[1]


def unmeasured(report, options, module_of=None):
    """Without a layout to measure: the first candidate of at most PAGE_ELEMENTS (or ``limit``) boxes,
    or the smallest when none is that small; not laid out (``.svg`` is None)."""
    graph = report.graph
    module_of = infer_modules(graph) if module_of is None else module_of
    fixed = options.collapse is not None
    budget = min(options.limit, PAGE_ELEMENTS)
    tried = []
    views = candidates(
        graph, report.findings, fold=options.fold, collapse=options.collapse, module_of=module_of, cache={}
    )
    for view in views:
        tried.append(view)
        if fixed or _elements(graph, view) <= budget:
            break
    else:
        view = min(tried, key=lambda v: _elements(graph, v))
    if not fixed and (view.groups or view.depth is not None):
        view.note = caption_note(graph, view)
    out = draw_with(report, view, options, options.rankdir or "TB")
    scale(out, options)
    return out


def caption_note(graph, view) -> str:
    """The caption of a drawing that folds or boxes: what was folded, and how to see everything."""
    what = []
    folds = [g for g in view.groups.values() if g.kind == "fold"]
    if folds:
        what.append(
            "repeated blocks folded ("
            + ", ".join(f"{g.title} {g.cls}" if g.cls else g.title for g in folds[:4])
            + (", ..." if len(folds) > 4 else "")
            + ")"
        )
    if view.depth is not None and any(g.kind == "module" for g in view.groups.values()):
        what.append(f"modules deeper than depth {view.depth} boxed")
    return (
        f"Drawn to fit a page: {graph.number_of_nodes()} nodes as {_elements(graph, view)} boxes "
        f"({'; '.join(what) or 'nothing folded'}); findings stay expanded. Everything: "
        f"render(path, collapse=False) (CLI --expand); collapse=N keeps modules to depth N."
    )
