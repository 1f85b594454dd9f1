"""Running Graphviz: one process per layout, with a time limit, a fallback when ``dot`` crashes, and the
size estimate that decides, before any layout, whether a drawing can fit a page at all.

See NOTE [layout budget] and NOTE [dot crashes].
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field

import graphviz
import networkx as nx

from gradscope.errors import RenderError

__all__ = [
    "LAYOUT_SECONDS",
    "MAX_LAYOUTS",
    "MAX_COST",
    "FALLBACKS",
    "LayoutTimeout",
    "Budget",
    "Estimate",
    "estimate",
    "run",
    "robust",
]

# NOTE [layout budget]
# The default drawing is searched (gradscope.views.fit), and each candidate costs one dot run. Three bounds
# keep the search in seconds on any graph: (1) before its layout, a candidate is measured on its element
# graph (`estimate`): the number of ranks it needs at least (its longest path) gives a lower bound on its
# longer side (a rank is at least RANK_TB pt tall top to bottom, RANK_LR pt wide left to right), so a
# candidate that cannot fit a page is never laid out; and dot's work grows with boxes plus the virtual
# nodes that long edges need (one per rank an edge crosses; dense concatenation makes them grow with the
# cube of the block's length), so a candidate over MAX_COST is never laid out either; (2) at most
# MAX_LAYOUTS layouts run; (3) all layouts of one search share LAYOUT_SECONDS: a layout still running when
# the budget is spent is stopped, and the search ends with the best drawing found so far, whose caption
# says so. MAX_COST was measured on dot 2.43: about 3,000 units lay out in 1-2 s on one core, DenseNet-121
# with its dense layers drawn as boxes (about 12,000) in 18 s.

#: Seconds all layouts of one search share.
LAYOUT_SECONDS = 8.0
#: The most layouts one search runs.
MAX_LAYOUTS = 8
#: The most boxes plus virtual nodes a candidate may have to be laid out (see NOTE [layout budget]).
MAX_COST = 2500
#: A rank's least extent in pt: one box (0.3 in tall, 0.75 in wide) plus the rank separation (0.3 in).
RANK_TB, RANK_LR = 43.2, 75.6

# NOTE [dot crashes]
# Graphviz 2.43 (Debian's) aborts on some drawings, e.g. `class2.c:148: merge_chain: Assertion
# ED_to_virt(e) == NULL` when two edges join the same two nodes, one of which sits on a rank with
# another node (`rank=same`) inside a cluster: a wrapped drawing (NOTE [wrapping columns]) of a graph with
# skip connections across columns makes exactly that. Every such crash we know involves clusters or rank
# constraints, so a crashed layout is retried, in order, without module clusters; without clusters and
# rank constraints (`rank=same`, `newrank`, wrapped columns); with another engine (neato: no ranks, edges
# still drawn as arrows). The caption says what was dropped. RenderError only when all of them fail.

#: The retries after a crash: (what the caption says was dropped, the drawing's changes, engine).
FALLBACKS = (
    ("module clusters", {"clusters": False}, "dot"),
    ("module clusters and rank constraints", {"clusters": False, "safe": True}, "dot"),
    ("module clusters and ranks (laid out by neato)", {"clusters": False, "safe": True}, "neato"),
)


class LayoutTimeout(RenderError):
    """A layout stopped because it ran past its time limit."""


class _Crash(RenderError):
    """Graphviz was killed by a signal (an assertion's abort, a segfault)."""


@dataclass(slots=True)
class Budget:
    """What one search may still spend: seconds and layouts (see NOTE [layout budget])."""

    seconds: float = field(default_factory=lambda: LAYOUT_SECONDS)
    layouts: int = field(default_factory=lambda: MAX_LAYOUTS)
    used: int = 0
    start: float = 0.0
    spent: bool = False  # a layout was stopped, or the search ended for want of budget

    def __post_init__(self) -> None:
        self.start = time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def can_run(self) -> bool:
        return self.used < self.layouts and self.left() > 0


@dataclass(frozen=True, slots=True)
class Estimate:
    """A candidate measured before its layout: boxes, ranks (at least), virtual nodes of long edges."""

    boxes: int
    ranks: int
    virtual: int

    @property
    def cost(self) -> int:
        return self.boxes + self.virtual

    def fits(self, rankdir: str, page: float) -> bool:
        """Whether a layout in ``rankdir`` can have its longer side within ``page`` pt (a lower bound)."""
        per = RANK_TB if rankdir == "TB" else RANK_LR
        return self.ranks * per - (per - RANK_TB / 2) <= page


def estimate(graph, view, boxes: int) -> Estimate:
    """The :class:`Estimate` of drawing ``view`` of ``graph`` (``boxes`` elements): ranks by longest path
    over the ops and boxes (leaves sit beside the op they feed), virtual nodes summed over edges."""
    owner, nodes = view.owner, graph.nodes
    dag = nx.DiGraph()
    for u, v in graph.edges():
        a, b = owner.get(u, u), owner.get(v, v)
        if a != b and (nodes[u]["kind"] == "op" or u in owner):
            dag.add_edge(a, b)
    rank: dict = {}
    try:
        for n in nx.topological_sort(dag):
            rank[n] = max((rank[p] + 1 for p in dag.predecessors(n)), default=0)
    except nx.NetworkXUnfeasible:  # not a DAG (a hand-made graph): no estimate, let dot decide
        return Estimate(boxes, 0, 0)
    virtual = sum(rank[b] - rank[a] - 1 for a, b in dag.edges())
    return Estimate(boxes, 1 + max(rank.values(), default=0), virtual)


def run(dot: graphviz.Digraph, fmt: str, timeout: float | None = None) -> bytes:
    """``dot``'s output as ``fmt`` from its engine (``dot.engine``), stopped after ``timeout`` seconds.

    Raises:
        RenderError: the engine is not installed, failed, or (:class:`LayoutTimeout`) ran too long.
    """
    engine = dot.engine or "dot"
    if shutil.which(engine) is None:
        raise graphviz.ExecutableNotFound([engine])
    try:
        done = subprocess.run(
            [engine, f"-T{fmt}"], input=dot.source.encode("utf-8"), capture_output=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        raise LayoutTimeout(f"Graphviz '{engine}' ran past {timeout:.1f} s and was stopped.") from None
    if done.returncode != 0:
        err = done.stderr.decode("utf-8", "replace").strip().splitlines()
        why = err[-1] if err else f"exit status {done.returncode}"
        # killed by a signal (an assertion's abort, a segfault): a crash the fallbacks may avoid
        kind = _Crash if done.returncode < 0 else RenderError
        raise kind(
            f"Graphviz '{engine}' failed to lay out the graph ({why}); write .dot, .json or .graphml, "
            "which need no layout."
        )
    return done.stdout


def robust(draw, pipe, timeout: float | None = None):
    """``draw()`` laid out to SVG by ``pipe``; when Graphviz crashes, drawn again and laid out with each of
    :data:`FALLBACKS` in turn (NOTE [dot crashes]). ``draw(**changes)`` makes the drawing.

    Returns ``(drawing, svg bytes, what was dropped or None)``.

    Raises:
        LayoutTimeout: a layout ran past ``timeout`` (no retry: a retry would not be faster).
        RenderError: every layout failed (the first failure's message).
    """
    out = draw()
    try:
        return out, pipe(out.dot, "svg", timeout), None
    except LayoutTimeout:
        raise
    except RenderError as exc:
        if not isinstance(exc, _Crash):
            raise
        first = exc
    for dropped, changes, engine in FALLBACKS:
        if shutil.which(engine) is None:
            continue
        out = draw(dropped=dropped, **changes)
        out.dot.engine = engine
        try:
            return out, pipe(out.dot, "svg", timeout), dropped
        except LayoutTimeout:
            raise
        except RenderError:
            continue
    raise first
