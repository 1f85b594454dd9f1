"""What the graph views draw: module attribution, folded repetition, collapsed modules.

Pure functions over ``report.graph``. :func:`build_view` decides, for every node, whether it is drawn on
its own or inside a group box (a collapsed module or a folded run of repetition), and which module
cluster it sits in. See NOTE [inferring modules] and NOTE [folding repetition].
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gradscope._format import lcp, one_line
from gradscope.findings import SEVERITIES
from gradscope.report import held_bytes

__all__ = ["Group", "View", "infer_modules", "find_folds", "build_view", "lcp", "depth"]

# NOTE [inferring modules]
# A traced graph carries `module` on op nodes; we use it as is. Otherwise a parameter node's module comes
# from its qualified name, and an op that consumes parameters directly belongs to the common prefix of
# their modules (TBackward0 of `a.weight` -> `a`). Every other op takes the common prefix of the nearest
# attributed ops before and after it in forward order (`seq`): the attention matmuls between
# `blocks.0.attn.qkv` and `blocks.0.attn.proj` land in `blocks.0.attn`, the loss after the last module in
# no module. This mimics the trace's sequence-range attribution (TORCH-FACTS section 5) without hooks.

# NOTE [folding repetition]
# Ops sorted by `seq` form a token string (op name + module with indices replaced by '#'). A run where the
# string repeats with period p at least MIN_REPS times (and covers at least MIN_OPS ops) is contracted into
# one box labelled "xN". Contracting a contiguous `seq` interval cannot create a cycle: data flows from
# lower to higher `seq`, so a path that leaves the interval never comes back into it.

MIN_REPS = 4
MIN_OPS = 24
MAX_PERIOD = 160
_DIGITS = re.compile(r"\d+")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}


@dataclass(slots=True)
class Group:
    """A box drawn in place of many nodes."""

    gid: str
    kind: str                      # "module" (collapsed module) or "fold" (repetition)
    title: str
    module: str | None             # where the box sits (its cluster); for a module box, the module itself
    members: list = field(default_factory=list)
    n_ops: int = 0
    saved_bytes: int = 0
    reps: int = 1
    pattern: tuple = ()
    worst: object = None           # the most severe Finding inside, or None
    span: tuple = ()               # (first, last) module a fold runs over, e.g. ("layers.0", "layers.94")


@dataclass(slots=True)
class View:
    """The drawing plan: per-node module and owner, the groups, and a note when we collapsed on our own."""

    module_of: dict
    owner: dict                    # node id -> group id for nodes drawn inside a box
    groups: dict                   # group id -> Group, in a deterministic order
    depth: int | None              # module depth kept as clusters (None: everything expanded)
    note: str | None = None


def depth(module: str | None) -> int:
    """``None -> 0``, ``'a' -> 1``, ``'a.b' -> 2``."""
    return 0 if not module else module.count(".") + 1


def truncate(module: str | None, n: int) -> str | None:
    """The ancestor of ``module`` at depth ``n`` (itself when shallower)."""
    if not module or depth(module) <= n:
        return module
    return ".".join(module.split(".")[:n]) or None


def _ops_in_order(graph) -> list:
    ops = [(d.get("seq") if d.get("seq") is not None else -1, i, n)
           for i, (n, d) in enumerate(graph.nodes(data=True)) if d["kind"] == "op"]
    ops.sort()
    return [n for _, _, n in ops]


def infer_modules(graph, order=None) -> dict:
    """Node id -> module name (or None); see NOTE [inferring modules]."""
    nodes = graph.nodes
    out = {n: d.get("module") for n, d in nodes(data=True)}
    traced = "called_modules" in graph.graph or any(
        d.get("module") for _, d in nodes(data=True) if d["kind"] == "op")
    if traced:
        return out
    order = _ops_in_order(graph) if order is None else order
    tagged: dict = {}
    for n in order:
        mods = [nodes[p].get("module") for p in graph.predecessors(n) if nodes[p]["kind"] == "param"]
        if mods:
            m = mods[0]
            for other in mods[1:]:
                m = lcp(m, other)
            tagged[n] = m
    before: dict = {}
    last = _NONE = object()
    for n in order:
        if n in tagged:
            last = tagged[n]
        else:
            before[n] = last
    nxt = _NONE
    for n in reversed(order):
        if n in tagged:
            nxt = tagged[n]
            out[n] = tagged[n]
        else:
            b = before[n]
            out[n] = None if b is _NONE or nxt is _NONE else lcp(b, nxt)
    return out


def _tokens(graph, order, module_of) -> list[int]:
    ids: dict = {}
    out = []
    for n in order:
        d = graph.nodes[n]
        key = (d["name"], _DIGITS.sub("#", module_of.get(n) or ""), bool(d.get("root")))
        out.append(ids.setdefault(key, len(ids)))
    return out


def find_folds(tokens: list[int], min_reps: int = MIN_REPS, min_ops: int = MIN_OPS,
               max_period: int = MAX_PERIOD) -> list[tuple[int, int, int]]:
    """Runs of repetition in ``tokens``: ``(start, period, reps)``, non-overlapping, left to right."""
    n = len(tokens)
    periods = range(1, min(max_period, n // max(min_reps, 1)) + 1)
    match = {}
    for p in periods:                       # match[p][i]: how far t[j] == t[j+p] holds from i on
        m = [0] * (n + 1)
        for i in range(n - p - 1, -1, -1):
            if tokens[i] == tokens[i + p]:
                m[i] = m[i + 1] + 1
        match[p] = m
    runs = []
    i = 0
    while i < n:
        best = None
        for p in periods:
            reps = 1 + match[p][i] // p
            cover = reps * p
            if reps >= min_reps and cover >= min_ops and (best is None or cover > best[0]):
                best = (cover, p, reps)
        if best is None:
            i += 1
            continue
        runs.append((i, best[1], best[2]))
        i += best[0]
    return runs


def _worst(findings):
    best = None
    for f in findings:
        if best is None or _RANK.get(f.severity, 9) < _RANK.get(best.severity, 9):
            best = f
    return best


def _finish(graph, group: Group, by_node: dict) -> Group:
    group.n_ops = sum(1 for n in group.members if graph.nodes[n]["kind"] == "op")
    group.saved_bytes = held_bytes(graph, group.members)
    group.worst = _worst(f for n in group.members for f in by_node.get(n, ()))
    return group


def _absorb_leaves(graph, owner: dict, groups: dict) -> None:
    """A leaf whose every consumer sits in one box goes into that box too."""
    for n, d in graph.nodes(data=True):
        if d["kind"] == "op" or n in owner:
            continue
        boxes = {owner.get(c) for c in graph.successors(n)}
        if len(boxes) == 1:
            gid = next(iter(boxes))
            if gid is not None:
                owner[n] = gid
                groups[gid].members.append(n)


def build_view(graph, findings=(), *, collapse=None, fold=None, limit: int = 1000) -> View:
    """Plan the drawing.

    Args:
        graph: ``report.graph``.
        findings: the report's findings (a box shows its worst one).
        collapse: ``None`` collapses automatically above ``limit`` drawn nodes; an int ``N`` draws module
            clusters down to depth ``N`` and folds every deeper module into one box; ``False`` expands all.
        fold: fold unrolled repetition into "xN" boxes; ``None`` means: when collapsing automatically.
        limit: the automatic threshold, in drawn nodes.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        from gradscope.errors import InputValueError
        raise InputValueError(f"limit must be a positive int (a node count), got {one_line(limit)}.")
    order = _ops_in_order(graph)
    module_of = infer_modules(graph, order)
    by_node: dict = {}
    for f in findings:
        if f.node is not None:
            by_node.setdefault(f.node, []).append(f)
    roots = {n for n, d in graph.nodes(data=True) if d.get("root")}
    big = graph.number_of_nodes() > limit
    if fold is None:
        fold = collapse is None and big
    owner: dict = {}
    groups: dict = {}
    if fold:
        toks = _tokens(graph, order, module_of)
        for start, period, reps in find_folds(toks):
            members = [n for n in order[start:start + period * reps] if n not in roots]
            first = order[start]
            mod = module_of.get(members[0])
            for n in members[1:]:
                mod = lcp(mod, module_of.get(n))
            names = tuple(graph.nodes[n]["name"] for n in order[start:start + period])
            g = Group(f"fold:{first}", "fold", f"x{reps}", mod, members, reps=reps, pattern=names)
            ends = [truncate(module_of.get(n), depth(mod) + 1) for n in (members[0], members[-1])]
            if all(ends) and ends[0] != ends[1]:
                g.span = tuple(ends)
            groups[g.gid] = g
            for n in members:
                owner[n] = g.gid
    _absorb_leaves(graph, owner, groups)
    note = None
    depth_kept = None
    if collapse is None and big:
        depth_kept = _auto_depth(graph, order, module_of, owner, roots, limit)
    elif collapse is not None and collapse is not False:
        depth_kept = int(collapse)
    if depth_kept is not None:
        for n in order:
            m = module_of.get(n)
            if n in owner or n in roots or depth(m) <= depth_kept:
                continue
            box = truncate(m, depth_kept + 1)
            gid = f"module:{box}"
            if gid not in groups:
                groups[gid] = Group(gid, "module", box, box)
            groups[gid].members.append(n)
            owner[n] = gid
    _absorb_leaves(graph, owner, groups)
    for g in groups.values():
        _finish(graph, g, by_node)
        if g.kind == "fold" and depth_kept is not None:
            g.module = truncate(g.module, depth_kept)
    if collapse is None and (groups or depth_kept is not None) and big:
        drawn = graph.number_of_nodes() - len(owner) + len(groups)
        what = []
        if any(g.kind == "fold" for g in groups.values()):
            what.append("repetition folded into xN boxes")
        if depth_kept is not None and any(g.kind == "module" for g in groups.values()):
            what.append(f"modules deeper than depth {depth_kept} collapsed")
        note = (f"Auto-collapsed: {graph.number_of_nodes()} nodes drawn as about {drawn} "
                f"({'; '.join(what) or 'nothing to fold'}). Expand with render(path, collapse=False) "
                f"or collapse=N for module depth N (CLI: --collapse N).")
    return View(module_of, owner, groups, depth_kept, note)


def _auto_depth(graph, order, module_of, owner, roots, limit) -> int | None:
    """The deepest module depth whose collapsed drawing stays under ``limit`` nodes (None: no need)."""
    loose = [n for n in order if n not in owner and n not in roots]
    base = graph.number_of_nodes() - len(loose) - len(owner)     # loose leaves and roots
    folds = len(set(owner.values()))
    deepest = max((depth(module_of.get(n)) for n in loose), default=0)
    if base + folds + len(loose) <= limit:
        return None
    for d in range(deepest - 1, -1, -1):
        boxes = {truncate(module_of.get(n), d + 1) for n in loose if depth(module_of.get(n)) > d}
        plain = sum(1 for n in loose if depth(module_of.get(n)) <= d)
        if folds + len(boxes) + plain + min(base, len(boxes) * 2 + plain) <= limit:
            return d
    return 0
