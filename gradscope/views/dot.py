"""The visual language: turn a :class:`~gradscope.views.collapse.View` of a report into a ``graphviz.Digraph``.

The legend lives in :mod:`gradscope.views.render`'s docstring and the README; colours are in :mod:`gradscope.views.style`.
Every drawn element gets a stable SVG ``id`` (the node id, ``fold:nK``, ``module:NAME``, ``unused:NAME``,
``cut:LOCATION``, ``nK~i`` for the i-th stub of a shared leaf) and ``gs-*`` classes for the HTML view.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import graphviz

from gradscope.views.collapse import View, depth, truncate
from gradscope.checks.inplace import stale_savers
from gradscope._format import human_bytes, shape_str
from gradscope.views.style import COLORS, esc
from gradscope.views.style import attrs as _attrs
from gradscope.views.style import dot_id as _q
from gradscope.views.style import label as _label
from gradscope.views.style import legend as _legend
from gradscope.views.style import saved_lines as _saved_lines
from gradscope.views.style import shade as _shade
from gradscope.views.style import short as _short

__all__ = ["Drawing", "draw", "COLORS"]

_MAX_UNUSED_NODES = 12


@dataclass(slots=True)
class Drawing:
    """The Digraph plus what the HTML view needs: per-element details and per-finding target ids."""

    dot: graphviz.Digraph
    elements: dict = field(default_factory=dict)     # element id -> details shown on hover/click
    targets: list = field(default_factory=list)      # finding index -> element ids to highlight
    element_of: dict = field(default_factory=dict)   # graph node id -> element id


def _finding_nodes(graph, finding) -> list:
    """The graph nodes a finding is drawn on: its node, and for an in-place hazard every other saver."""
    if finding.node is None or finding.node not in graph:
        return []
    if finding.kind == "inplace-hazard":
        return stale_savers(graph, finding.node)
    return [finding.node]


class _Builder:
    def __init__(self, report, view: View, show_saved: bool, clusters, legend: bool, limit: int):
        self.limit = limit
        self.g = report.graph
        self.findings = list(report.findings)
        self.saved_bytes = report.saved_bytes
        self.cut_of: dict = {}         # finding params -> cut element ids
        self.view = view
        self.show_saved = show_saved
        self.clusters = clusters
        self.legend = legend
        self.items: dict = {}          # element id -> (cluster, attrs)
        self.edges: dict = {}          # (a, b) -> attrs
        self.names: dict = {}          # element id -> DOT node name
        self.out = Drawing(graphviz.Digraph("gradscope"))
        self.flagged: dict = {}        # node id -> [Finding]
        for f in self.findings:
            for n in _finding_nodes(self.g, f):
                self.flagged.setdefault(n, []).append(f)

    # -- placement -------------------------------------------------------------------------------
    def cluster_of_node(self, n) -> str | None:
        m = self.view.module_of.get(n)
        return truncate(m, self.view.depth) if self.view.depth is not None else m

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
        top = max([d["saved_bytes"] for _, d in g.nodes(data=True)] +
                  [grp.saved_bytes for grp in view.groups.values()] + [0])
        self.compact = g.number_of_nodes() - len(view.owner) + len(view.groups) > self.limit
        if self.show_saved is None:
            self.show_saved = not self.compact
        for gid, grp in view.groups.items():
            self.group(gid, grp, top)
        for n, d in g.nodes(data=True):
            if n in view.owner:
                self.out.element_of[n] = view.owner[n]
            elif d["kind"] == "op":
                self.op(n, d, top)
        for n, d in g.nodes(data=True):
            if d["kind"] != "op" and n not in view.owner:
                self.leaf(n, d)
        for u, v in g.edges():
            if g.nodes[u]["kind"] == "op" or u in view.owner:
                self.edge(self.out.element_of[u], self.out.element_of[v])
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
            attrs.update(color=COLORS["finding"], penwidth="3")

    def op(self, n, d, top):
        lines = [d["name"]]
        outs = d.get("out_shapes") or []
        if d.get("root"):
            lines.append("root -> " + ", ".join(shape_str(s) for s in d.get("root_shapes") or outs[:1]))
        elif outs and not self.compact:
            lines.append("-> " + shape_str(outs[0]))
        if self.show_saved and d["saved"]:
            lines += _saved_lines(d["saved"])
        for f in self.flagged.get(n, ()):
            lines.append(f"!! {f.kind}")
        if d.get("planned"):        # set by Plan.render(): the module is checkpointed / offloaded
            lines.append(f"plan: {d['planned']}")
        classes = ["gs-op"] + (["gs-root"] if d.get("root") else []) + (["gs-planned"] if d.get("planned") else [])
        attrs = {"fillcolor": _shade(d["saved_bytes"], top)}
        if d.get("memory_peak"):    # set by BackwardMemory.render(): backward's memory peak is here
            lines.append(d["memory_peak"])
            classes.append("gs-memory-peak")
            attrs.update(color=COLORS["finding"], penwidth="3")
        if d.get("root"):
            attrs.update(peripheries="2", penwidth="2")
        info = {"kind": "op", "name": d["name"], "node": n, "module": self.view.module_of.get(n),
                "bytes": human_bytes(d["saved_bytes"]), "saved": _saved_lines(d["saved"]) if d["saved"] else []}
        self.add(n, self.cluster_of_node(n), _label(lines), classes, info, **attrs)
        self.out.element_of[n] = n

    def group(self, gid, grp, top):
        if grp.kind == "fold":
            head = f"{grp.title}  repeated block ({len(grp.pattern)} ops each)"
            pat = ", ".join(grp.pattern[:3]) + (", ..." if len(grp.pattern) > 3 else "")
            lines = [head, pat] + ([f"{grp.span[0]} ... {grp.span[1]}"] if grp.span else [])
            cluster = grp.module
        else:
            lines = [f"{grp.title}  (collapsed)"]
            cluster = truncate(grp.module, depth(grp.module) - 1)
        lines.append(f"{grp.n_ops} ops, {human_bytes(grp.saved_bytes)} saved")
        if grp.worst is not None:
            lines.append(f"!! {grp.worst.kind}")
        info = {"kind": grp.kind, "name": grp.title, "module": grp.module, "ops": grp.n_ops,
                "bytes": human_bytes(grp.saved_bytes), "members": len(grp.members),
                "pattern": list(grp.pattern[:12]), "worst": grp.worst.message if grp.worst else None}
        shade = _shade(grp.saved_bytes, top)
        fill = COLORS["group"] if shade == COLORS["shades"][0] else shade
        self.add(gid, cluster, _label(lines), ["gs-group", f"gs-{grp.kind}"], info, shape="box3d",
                 style="filled", fillcolor=fill, color=COLORS["group_line"])

    def leaf(self, n, d):
        kind = d["kind"]
        users = list(dict.fromkeys(self.out.element_of[c] for c in self.g.successors(n)))
        base = {"fillcolor": COLORS[kind], "color": COLORS[kind + "_line"]}
        info = {"kind": kind, "name": d["name"], "node": n, "module": d.get("module"),
                "shape": shape_str(d.get("shape")), "dtype": d.get("dtype"), "bytes": "0 B", "saved": []}
        if len(users) <= 1:
            cluster = self.cluster_of(users[0]) if users else None
            lines = [_short(d["name"], cluster) if kind == "param" else d["name"],
                     f"{shape_str(d.get('shape'))} {d.get('dtype') or ''}"]
            classes = [f"gs-{kind}"]
            if d.get("root"):                               # inspect(leaf): the root is the leaf itself
                classes.append("gs-root")
                base.update(peripheries="2", penwidth="2")
            self.add(n, cluster, _label(lines), classes, info, **base)
            self.out.element_of[n] = n
            for u in users:
                self.edge(n, u)
            return
        for i, u in enumerate(users):
            sid = f"{n}~{i}"
            cluster = self.cluster_of(u)
            label = _label([_short(d["name"], cluster), f"shared x{self.g.out_degree(n)}"])
            self.add(sid, cluster, label, [f"gs-{kind}", "gs-stub", f"gs-of-{n}"], info, fontsize="8",
                     style="rounded,filled,dashed", **base)
            self.edge(sid, u)
        self.out.element_of[n] = f"{n}~0"

    def edge(self, a, b):
        if a != b:
            self.edges.setdefault((a, b), None)

    def unused_and_cuts(self):
        params = self.g.graph.get("params", {})
        unused = [name for name, p in params.items() if p.get("requires_grad") and p.get("node") is None]
        if not unused:
            return
        per_param = len(unused) <= _MAX_UNUSED_NODES
        groups: dict = {}
        for name in unused:
            groups.setdefault(name if per_param else (name.rpartition(".")[0] or name), []).append(name)
        for key, names in groups.items():
            eid = f"unused:{key}"
            if per_param:
                p = params[key]
                lines = [key, f"{shape_str(p.get('shape'))} {p.get('dtype') or ''}", "no gradient"]
            else:
                lines = [key or "(top level)", f"{len(names)} parameters, no gradient"] + names[:3] + (
                    ["..."] if len(names) > 3 else [])
            info = {"kind": "unused", "name": key, "params": names, "module": key.rpartition(".")[0] or None,
                    "bytes": "0 B", "saved": []}
            self.add(eid, "\0unused", _label(lines), ["gs-param", "gs-unused"], info,
                     fillcolor=COLORS["finding_fill"], color=COLORS["finding"], style="rounded,filled,dashed")
            for name in names:
                self.out.element_of[name] = eid
        events = [e for e in self.g.graph.get("events", ()) if e.get("kind") != "inplace"]
        for f in self.findings:
            if f.kind != "detached-branch":
                continue
            ev = next((e for e in events if set(f.params) & set(e.get("params", ()))), None)
            loc = f.location or (ev or {}).get("location") or "?"
            eid = f"cut:{loc}"
            if eid not in self.items:
                op = (ev or {}).get("op") or "cut"
                self.add(eid, None, _label([f"CUT: {op}", loc]), ["gs-cut"],
                         {"kind": "cut", "name": op, "location": loc, "bytes": "0 B", "saved": []},
                         shape="octagon", style="filled", fillcolor=COLORS["finding_fill"],
                         color=COLORS["finding"])
                consumer = (ev or {}).get("node")
                if consumer in self.out.element_of:
                    self.edges[(eid, self.out.element_of[consumer])] = {"style": "dashed",
                                                                        "color": COLORS["finding"]}
            for p in f.params:
                if p in self.out.element_of:
                    self.edges[(self.out.element_of[p], eid)] = {"style": "dashed", "color": COLORS["finding"]}
            self.cut_of[f.params] = [eid]

    # -- output ----------------------------------------------------------------------------------
    def emit(self):
        dot = self.out.dot
        dot.attr("graph", rankdir="TB", newrank="true", nodesep="0.2", ranksep="0.3", fontname="Helvetica",
                 fontsize="10", id="gradscope-graph")
        dot.attr("node", shape="box", style="rounded,filled", fontname="Helvetica", fontsize="10",
                 color=COLORS["op_line"], height="0.3", margin="0.08,0.03")
        dot.attr("edge", color=COLORS["edge"], arrowsize="0.6")
        clusters = self.clusters if self.clusters is not None else len(self.items) <= self.limit
        tree: dict = {}                                    # cluster -> [element ids]
        for eid, (cluster, _) in self.items.items():
            if not clusters and cluster != "\0unused":
                cluster = None
            tree.setdefault(cluster, []).append(eid)
        self._emit_clusters(dot.body, tree)
        for (a, b), attrs in self.edges.items():
            dot.body.append(f"\t{_q(self.names[a])} -> {_q(self.names[b])}{_attrs(attrs) if attrs else ''}\n")
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
        # Written as DOT lines directly: graphviz's per-attribute quoting was most of to_dot's time.
        def nodes(eids, indent):
            body.extend(f"{indent}{_q(self.names[e])}{_attrs(self.items[e][1])}\n" for e in eids)

        nodes(tree.get(None, ()), "\t")
        if "\0unused" in tree:
            body.append("\tsubgraph cluster_unused {\n\t\t" + _attrs(dict(
                label="no gradient: unreachable from the root", style="dashed,rounded", color=COLORS["finding"],
                fontcolor=COLORS["finding"], id="cluster_unused"), sep="\n\t\t", bracket=False) + "\n")
            nodes(tree["\0unused"], "\t\t")
            body.append("\t}\n")
        modules = sorted({m for m in tree if m and m != "\0unused"} |
                         {".".join(m.split(".")[:k]) for m in tree if m and m != "\0unused"
                          for k in range(1, depth(m))})
        children: dict = {}
        for m in modules:
            children.setdefault(truncate(m, depth(m) - 1) if depth(m) > 1 else None, []).append(m)
        stack = [(m, 1, False) for m in reversed(children.get(None, []))]
        while stack:                                       # explicit stack: no recursion
            m, level, done = stack.pop()
            indent = "\t" * level
            if done:
                body.append(f"{indent}}}\n")
                continue
            body.append(f"{indent}subgraph {_q('cluster_' + m)} {{\n{indent}\t" + _attrs(dict(
                label=esc(m), style="rounded", color="#cbd5e1", fontcolor="#475569", id=f"cluster:{m}"),
                sep=f"\n{indent}\t", bracket=False) + "\n")
            nodes(tree.get(m, ()), indent + "\t")
            stack.append((m, level, True))
            stack.extend((c, level + 1, False) for c in reversed(children.get(m, [])))

    def _caption(self) -> list[str]:
        g = self.g
        n_err = sum(1 for f in self.findings if f.severity == "error")
        lines = [f"gradscope: {_count(g.number_of_nodes(), 'node')}, {human_bytes(self.saved_bytes)} saved for "
                 f"backward, {_count(len(self.findings), 'finding')} ({_count(n_err, 'error')})"]
        kinds = list(dict.fromkeys(f.kind for f in self.findings))
        if kinds:
            lines.append("findings (red): " + ", ".join(kinds))
        if self.view.note:
            lines.append(self.view.note)
        if self.compact:
            lines.append(f"Large drawing: labels shortened and module clusters left out to keep the layout fast "
                         f"(more than {self.limit} elements); see the .html view for saved tensors.")
        return lines


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def draw(report, view: View, *, show_saved: bool = True, clusters=None, legend: bool = False,
         limit: int = 1000) -> Drawing:
    """Build the :class:`Drawing` of ``report`` following ``view``.

    ``clusters=None`` draws module clusters when at most ``limit`` elements are drawn: beyond that, dot
    spends most of its time on clusters (an expanded 200-step LSTM: 23 s with them, 4 s without).
    """
    return _Builder(report, view, show_saved, clusters, legend, limit).build()
