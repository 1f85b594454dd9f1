"""The parts of a drawing around the ops: module clusters (one per module call) and the "no gradient" grid.

Functions over :class:`gradscope.views.dot._Builder` (``b``): they read its elements and write DOT lines.
"""

from __future__ import annotations

import math

from gradscope._format import shape_str
from gradscope.findings import DETACHED_BRANCH
from gradscope.graph import PARAMS
from gradscope.views.collapse import cut_site, depth, truncate
from gradscope.views.style import COLORS, esc
from gradscope.views.style import attrs as _attrs
from gradscope.views.style import dot_id as _q
from gradscope.views.style import label as _label
from gradscope.views.style import short as _short

__all__ = ["calls", "call_label", "emit_clusters", "unused_and_cuts"]

_MAX_UNUSED_NODES = 12
_MAX_UNUSED_BOXES = 24


def calls(graph, module_of) -> dict:
    """Op -> [call number of its module at depth 1, 2, ...]; a call is a run of consecutive ops (in
    forward order) inside that module."""
    order = sorted(
        (d.get("seq") if d.get("seq") is not None else -1, i, n)
        for i, (n, d) in enumerate(graph.nodes(data=True))
        if d["kind"] == "op"
    )
    counts: dict = {}
    prev: list = []
    out = {}
    for _, _, n in order:
        m = module_of.get(n)
        parts = m.split(".") if m else []
        prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
        row = []
        for i, p in enumerate(prefixes):
            if i >= len(prev) or prev[i] != p:
                counts[p] = counts.get(p, 0) + 1
            row.append(counts[p])
        prev = prefixes
        out[n] = row
    return out


def call_label(key: str) -> str:
    """``enc.drop#3`` -> ``enc.drop (call 3)``."""
    if "#" not in key:
        return key
    calls = [p.partition("#")[2] for p in key.split(".") if "#" in p]
    return ".".join(p.partition("#")[0] for p in key.split(".")) + f" (call {calls[-1]})"


def unused_and_cuts(b) -> None:
    """The "no gradient" cluster (a grid, by module when many) and the cuts that explain it."""
    params = b.g.graph.get(PARAMS, {})
    unused = [name for name, p in params.items() if p.get("requires_grad") and p.get("node") is None]
    if not unused:
        return
    per_param = len(unused) <= _MAX_UNUSED_NODES
    groups: dict = {}
    level = max(depth(n) for n in unused) - 1
    while True:  # by module, at the deepest level giving few enough boxes
        groups = {}
        for name in unused:
            groups.setdefault(
                name if per_param else (truncate(name, max(level, 1)) if depth(name) > 1 else name), []
            ).append(name)
        if per_param or len(groups) <= _MAX_UNUSED_BOXES or level <= 1:
            break
        level -= 1
    for key, names in groups.items():
        eid = f"unused:{key}"
        if per_param:
            p = params[key]
            lines = [key, f"{shape_str(p.get('shape'))} {p.get('dtype') or ''}", "no gradient"]
        else:
            rest = [_short(x, key) for x in names]
            lines = [
                key or "(top level)",
                f"{len(names)} parameters, no gradient",
                ", ".join(rest[:3]) + (", ..." if len(rest) > 3 else ""),
            ]
        info = {
            "kind": "unused",
            "name": key,
            "params": names,
            "module": key.rpartition(".")[0] or None,
            "bytes": "0 B",
            "saved": [],
        }
        b.add(
            eid,
            "\0unused",
            _label(lines),
            ["gs-param", "gs-unused"],
            info,
            fillcolor=COLORS["finding_fill"],
            color=COLORS["finding"],
            style="rounded,filled,dashed",
        )
        for name in names:
            b.out.element_of[name] = eid
    for f in b.findings:
        if f.kind != DETACHED_BRANCH:
            continue
        ev, consumer = cut_site(b.g, f)
        loc = f.location or (ev or {}).get("location") or "?"
        eid = f"cut:{loc}"
        if eid not in b.items:
            op = (ev or {}).get("op") or "cut"
            near = b.out.element_of.get(consumer) if consumer is not None else None
            b.add(
                eid,
                b.cluster_of(near) if near is not None else None,
                _label([f"CUT: {op}", loc]),
                ["gs-cut"],
                {"kind": "cut", "name": op, "location": loc, "bytes": "0 B", "saved": []},
                shape="octagon",
                style="filled",
                fillcolor=COLORS["finding_fill"],
                color=COLORS["finding"],
            )
            if consumer in b.out.element_of:  # next to the op made right after the cut
                b.edges[(eid, b.out.element_of[consumer])] = {"style": "dashed", "color": COLORS["finding"]}
        for p in f.params:
            if p in b.out.element_of:
                b.edges[(b.out.element_of[p], eid)] = {"style": "dashed", "color": COLORS["finding"]}
        b.cut_of[f.params] = [eid]


def emit_clusters(b, body: list, tree: dict) -> None:
    """Write the elements into their (nested) module clusters as DOT lines."""

    # Written as DOT lines directly: graphviz's per-attribute quoting was most of to_dot's time.
    def nodes(eids, indent):
        body.extend(f"{indent}{_q(b.names[e])}{_attrs(b.items[e][1])}\n" for e in eids)
        here = set(eids)
        body.extend(
            f"{indent}{{rank=same; {_q(b.names[e])}; {_q(b.names[b.beside[e]])}}}\n"
            for e in eids
            if b.beside.get(e) in here
        )

    nodes(tree.get(None, ()), "\t")
    if "\0unused" in tree:
        body.append(
            "\tsubgraph cluster_unused {\n\t\t"
            + _attrs(
                dict(
                    label="no gradient: unreachable from the root",
                    style="dashed,rounded",
                    color=COLORS["finding"],
                    fontcolor=COLORS["finding"],
                    id="cluster_unused",
                ),
                sep="\n\t\t",
                bracket=False,
            )
            + "\n"
        )
        nodes(tree["\0unused"], "\t\t")
        cells = tree["\0unused"]  # a compact grid: invisible edges stack the rows
        cols = max(1, math.ceil(math.sqrt(len(cells) * 1.5)))
        body.extend(
            f"\t\t{_q(b.names[cells[i]])} -> {_q(b.names[cells[i + cols]])} [style=invis]\n"
            for i in range(len(cells) - cols)
        )
        body.append("\t}\n")
    modules = sorted(
        {m for m in tree if m and m != "\0unused"}
        | {".".join(m.split(".")[:k]) for m in tree if m and m != "\0unused" for k in range(1, depth(m))}
    )
    children: dict = {}
    for m in modules:
        children.setdefault(truncate(m, depth(m) - 1) if depth(m) > 1 else None, []).append(m)
    stack = [(m, 1, False) for m in reversed(children.get(None, []))]
    while stack:  # explicit stack: no recursion
        m, level, done = stack.pop()
        indent = "\t" * level
        if done:
            body.append(f"{indent}}}\n")
            continue
        if not tree.get(m) and len(children.get(m, ())) == 1:  # a cluster around one cluster only
            stack.append((children[m][0], level, False))
            continue
        body.append(
            f"{indent}subgraph {_q('cluster_' + m)} {{\n{indent}\t"
            + _attrs(
                dict(
                    label=esc(call_label(m)), style="rounded", color="#cbd5e1", fontcolor="#475569", id=f"cluster:{m}"
                ),
                sep=f"\n{indent}\t",
                bracket=False,
            )
            + "\n"
        )
        nodes(tree.get(m, ()), indent + "\t")
        stack.append((m, level, True))
        stack.extend((c, level + 1, False) for c in reversed(children.get(m, [])))
