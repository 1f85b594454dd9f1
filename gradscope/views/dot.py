"""The visual language: turn a :class:`~gradscope.views.collapse.View` of a report into a ``graphviz.Digraph``.

The legend lives in :mod:`gradscope.views.render`'s docstring and docs/pictures.md; colours are in
:mod:`gradscope.views.style`.
Every drawn element gets a stable SVG ``id`` (the node id, ``fold:nK``, ``module:NAME``, ``unused:NAME``,
``cut:LOCATION``, ``nK~i`` for the i-th stub of a shared leaf) and ``gs-*`` classes for the HTML view.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import graphviz
import networkx as nx

from gradscope._format import human_bytes, plural
from gradscope.graph.attribution import node_bytes
from gradscope.views import elements
from gradscope.views.clusters import calls, emit_clusters, unused_and_cuts
from gradscope.views.collapse import View, depth, finding_nodes, truncate
from gradscope.views.style import COLORS, esc
from gradscope.views.style import attrs as _attrs
from gradscope.views.style import dot_id as _q
from gradscope.views.style import legend as _legend
from gradscope.views.wrap import wrap

__all__ = ["Drawing", "draw", "COLORS"]


@dataclass(slots=True)
class Drawing:
    """The Digraph plus what the HTML view needs: per-element details and per-finding target ids."""

    dot: graphviz.Digraph
    elements: dict = field(default_factory=dict)  # element id -> details shown on hover/click
    targets: list = field(default_factory=list)  # finding index -> element ids to highlight
    element_of: dict = field(default_factory=dict)  # graph node id -> element id
    view: View | None = None  # the plan drawn (groups, module of each node)
    svg: str | None = None  # dot's SVG output, once laid out
    size: tuple | None = None  # (width, height) of the laid-out drawing, in pt


_finding_nodes = finding_nodes
#: Font size (pt) of the elements a finding is drawn on, and of everything else.
FINDING_FONT, FONT = 14, 10


class _Builder:
    def __init__(
        self,
        report,
        view: View,
        show_saved: bool,
        clusters,
        legend: bool,
        limit: int,
        rankdir: str = "TB",
        context=(),
        columns: int = 1,
        safe: bool = False,
        dropped: str | None = None,
    ):
        self.limit = limit
        self.safe = safe  # no rank constraints (NOTE [dot crashes] in gradscope/views/layout.py)
        self.dropped = dropped  # what a retry after a Graphviz crash left out, for the caption
        self.columns = columns  # > 1: wrapped into that many columns (NOTE [wrapping columns])
        self.extra: list = []  # DOT lines written after the edges
        self.rankdir = rankdir
        # nodes outside a drilled-down box, drawn as small stubs (render.drawing(report, box=...))
        self.context = set(context) | set(report.graph.graph.get("context", ()))
        self.own = node_bytes(report.graph)  # activations each node holds, each storage once
        self.by_ref = {n: b - self.own.get(n, 0) for n, b in node_bytes(report.graph, params=True).items()}
        self.g = report.graph
        self.findings = list(report.findings)
        self.saved_bytes = report.saved_bytes
        self.cut_of: dict = {}  # finding params -> cut element ids
        self.view = view
        self.show_saved = show_saved
        self.clusters = clusters
        self.legend = legend
        self.items: dict = {}  # element id -> (cluster, attrs)
        self.edges: dict = {}  # (a, b) -> attrs
        self.beside: dict = {}  # leaf element -> the one element it feeds: drawn on the same rank
        self.calls: dict | None = None  # op -> call count per module level (see call_key)
        self.names: dict = {}  # element id -> DOT node name
        self.out = Drawing(graphviz.Digraph("gradscope"), view=view)
        self.flagged: dict = {}  # node id -> [Finding]
        for f in self.findings:
            for n in _finding_nodes(self.g, f):
                self.flagged.setdefault(n, []).append(f)

    # -- placement -------------------------------------------------------------------------------
    def cluster_of_node(self, n) -> str | None:
        m = self.view.module_of.get(n)
        if n in self.context:
            return None
        if self.view.depth is not None:
            k = self.view.depth
            while k < depth(m) and truncate(m, k + 1) in self.view.keep_open:
                k += 1
            m = truncate(m, k)
        return self.call_key(m, n)

    def call_key(self, m, n) -> str | None:
        """``m`` with the call of each level that op ``n`` ran in: ``enc.drop#3`` (NOTE [one cluster per
        call]: a module called at several places, like T5's shared dropout, would otherwise be one
        cluster stretched over the whole drawing)."""
        if not m:
            return m
        if self.calls is None:
            self.calls = calls(self.g, self.view.module_of)
        counts = self.calls.get(n, ())
        parts = m.split(".")
        return ".".join(p + (f"#{counts[i]}" if i < len(counts) and counts[i] > 1 else "") for i, p in enumerate(parts))

    def cluster_of(self, eid) -> str | None:
        return self.items[eid][0]

    def add(self, eid, cluster, label, classes, info, **attrs):
        attrs.update(label=label, id=eid, **{"class": " ".join(classes)})
        # DOT names: node ids as they are; others ("unused:x", "fold:n3") get a plain name, because
        # graphviz reads "a:b" in an edge as node a, port b. The SVG id keeps the readable form.
        self.names[eid] = eid if ":" not in eid else f"g{len(self.names)}"
        self.items[eid] = (cluster, attrs)
        self.out.elements[eid] = info

    # -- elements --------------------------------------------------------------------------------
    def build(self) -> Drawing:
        g, view = self.g, self.view
        top = max(list(self.own.values()) + [grp.saved_bytes for grp in view.groups.values()] + [0])
        self.compact = g.number_of_nodes() - len(view.owner) + len(view.groups) > self.limit
        if self.show_saved is None:
            self.show_saved = not self.compact
        for gid, grp in view.groups.items():
            elements.group(self, gid, grp, top)
        for n, d in g.nodes(data=True):
            if n in view.owner:
                self.out.element_of[n] = view.owner[n]
            elif d["kind"] == "op":
                elements.op(self, n, d, top)
        for n, d in g.nodes(data=True):
            if d["kind"] != "op" and n not in view.owner:
                elements.leaf(self, n, d)
        for u, v in g.edges():
            if g.nodes[u]["kind"] == "op" or u in view.owner:
                self.edge(self.out.element_of[u], self.out.element_of[v])
        for n, d in g.nodes(data=True):  # weight.t(): on its consumer's rank too
            if (
                d["kind"] == "op"
                and n not in view.owner
                and g.in_degree(n)
                and g.out_degree(n) == 1
                and all(g.nodes[p]["kind"] != "op" for p in g.predecessors(n))
            ):
                self.beside[n] = self.out.element_of[next(iter(g.successors(n)))]
        self.unused_and_cuts()
        for f in self.findings:
            tg = [self.out.element_of[n] for n in _finding_nodes(g, f) if n in self.out.element_of]
            tg += [self.out.element_of[p] for p in f.params if p in self.out.element_of]
            tg += self.cut_of.get(f.params, [])
            self.out.targets.append(list(dict.fromkeys(tg)))
            for eid in tg:
                self.mark(eid, f)
        self.emit()
        return self.out

    def mark(self, eid, finding):
        attrs = self.items[eid][1]
        if "gs-finding" not in attrs["class"]:
            attrs["class"] += " gs-finding"
            attrs.update(color=COLORS["finding"], penwidth="3", fontsize=str(FINDING_FONT))

    def edge(self, a, b):
        if a != b:
            self.edges.setdefault((a, b), None)

    def unused_and_cuts(self):
        unused_and_cuts(self)

    # -- output ----------------------------------------------------------------------------------
    def emit(self):
        dot = self.out.dot
        dot.attr(
            "graph",
            rankdir=self.rankdir,
            **({} if self.safe else {"newrank": "true"}),
            nodesep="0.2",
            ranksep="0.3",
            fontname="Helvetica",
            fontsize="10",
            id="gradscope-graph",
        )
        dot.attr(
            "node",
            shape="box",
            style="rounded,filled",
            fontname="Helvetica",
            fontsize="10",
            color=COLORS["op_line"],
            height="0.3",
            margin="0.08,0.03",
        )
        dot.attr("edge", color=COLORS["edge"], arrowsize="0.6")
        clusters = self.clusters if self.clusters is not None else len(self.items) <= self.limit
        tree: dict = {}  # cluster -> [element ids]
        for eid, (cluster, _) in self.items.items():
            if not clusters and cluster != "\0unused":
                cluster = None
            tree.setdefault(cluster, []).append(eid)
        for a, b in self._spine():
            self.edges[(a, b)] = dict(self.edges[(a, b)] or {}, weight="8")
        if self.safe:
            self.beside = {}
        elif self.columns > 1:
            wrap(self, self.columns)
        self._emit_clusters(dot.body, tree)
        for (a, b), attrs in self.edges.items():
            dot.body.append(f"\t{_q(self.names[a])} -> {_q(self.names[b])}{_attrs(attrs) if attrs else ''}\n")
        dot.body.extend(self.extra)
        if self.compact:
            # NOTE [big layouts]: dot's x-coordinate pass (network simplex) is superlinear: on an expanded
            # 96-layer transformer (7.3k nodes, 25k with virtual nodes) it alone ran for minutes. Capping
            # its iterations costs some width and keeps the layout at tens of seconds.
            dot.attr("graph", nslimit="0.5", searchsize="10")
        label = self._caption()
        dot.attr("graph", label="".join(esc(x) + "\\l" for x in label), labelloc="b", labeljust="l")
        if self.legend:
            _legend(dot)

    def _emit_clusters(self, body: list, tree: dict) -> None:
        emit_clusters(self, body, tree)

    def _spine(self) -> list:
        """The edges of the longest path: heavy weight keeps them short and straight (NOTE [no staircase]).
        Not dot's ``group``: with clusters it makes dot fail ("trouble in init_rank") on big graphs."""
        if len(self.items) > self.limit:
            return []
        dag = nx.DiGraph(e for e, attrs in self.edges.items() if not attrs or "style" not in attrs)
        if not nx.is_directed_acyclic_graph(dag):
            return []
        path = nx.dag_longest_path(dag)
        return list(zip(path, path[1:]))

    def _caption(self) -> list[str]:
        g = self.g
        n_err = sum(1 for f in self.findings if f.severity == "error")
        acts = sum(self.own.values())
        held = f"{human_bytes(acts)} of activations saved for backward" + (
            f" (+ {human_bytes(self.saved_bytes - acts)} of parameters saved by reference)"
            if self.saved_bytes > acts
            else ""
        )
        lines = [
            f"gradscope: {plural(g.number_of_nodes(), 'node')}, {held}, "
            f"{plural(len(self.findings), 'finding')} ({plural(n_err, 'error')})"
        ]
        kinds = list(dict.fromkeys(f.kind for f in self.findings))
        if kinds:
            lines.append("findings (red): " + ", ".join(kinds))
        if self.view.note:
            lines.append(self.view.note)
        if self.dropped:
            lines.append(
                f"Graphviz crashed laying this drawing out (a known bug of some Graphviz releases), so it was "
                f"drawn without {self.dropped}."
            )
        if self.compact:
            lines.append(
                f"Large drawing: labels shortened and module clusters left out to keep the layout fast "
                f"(more than {self.limit} elements); see the .html view for saved tensors."
            )
        return [part for line in lines for part in textwrap.wrap(line, 110)]


def draw(
    report,
    view: View,
    *,
    show_saved: bool = True,
    clusters=None,
    legend: bool = False,
    limit: int = 1000,
    rankdir: str = "TB",
    context=(),
    columns: int = 1,
    safe: bool = False,
    dropped: str | None = None,
) -> Drawing:
    """Build the :class:`Drawing` of ``report`` following ``view``.

    ``clusters=None`` draws module clusters when at most ``limit`` elements are drawn: beyond that, dot
    spends most of its time on clusters (an expanded 200-step LSTM: 23 s with them, 4 s without).
    ``safe`` leaves out every rank constraint (no ``newrank``, no leaf beside its op, no wrapped columns)
    and ``dropped`` says in the caption what a retry after a Graphviz crash left out (NOTE [dot crashes]).
    """
    return _Builder(report, view, show_saved, clusters, legend, limit, rankdir, context, columns, safe, dropped).build()
