"""What the graph views draw: module attribution, folded repetition, collapsed modules.

Pure functions over ``report.graph``. :func:`build_view` decides, for every node, whether it is drawn on
its own or inside a group box (a collapsed module or a folded run of repetition), and which module
cluster it sits in. See NOTE [inferring modules] (gradscope/graph/modules.py) and, in :mod:`gradscope.views.folds`,
NOTE [folding repetition].
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gradscope._format import lcp, one_line
from gradscope.findings import DETACHED_BRANCH, INPLACE_HAZARD, SEVERITIES
from gradscope.graph import EVENTS, forward_order
from gradscope.graph import node_modules as infer_modules
from gradscope.views.folds import MIN_OPS, MIN_REPS, Group, find_folds
from gradscope.views.folds import chains as _chains
from gradscope.views.repeats import fold_runs

__all__ = [
    "Group",
    "View",
    "infer_modules",
    "find_folds",
    "build_view",
    "finding_nodes",
    "lcp",
    "depth",
    "fold_lines",
    "cut_site",
]

# Module attribution: NOTE [inferring modules] in gradscope/graph/modules.py (one answer for the picture and
# report.memory()).

_RANK = {s: i for i, s in enumerate(SEVERITIES)}


@dataclass(slots=True)
class View:
    """The drawing plan: per-node module and owner, the groups, and a note when we collapsed on our own."""

    module_of: dict
    owner: dict  # node id -> group id for nodes drawn inside a box
    groups: dict  # group id -> Group, in a deterministic order
    depth: int | None  # module depth kept as clusters (None: everything expanded)
    note: str | None = None
    keep_open: set = field(default_factory=set)  # modules kept open down to a finding's node


def depth(module: str | None) -> int:
    """``None -> 0``, ``'a' -> 1``, ``'a.b' -> 2``."""
    return 0 if not module else module.count(".") + 1


def truncate(module: str | None, n: int) -> str | None:
    """The ancestor of ``module`` at depth ``n`` (itself when shallower)."""
    if not module or depth(module) <= n:
        return module
    return ".".join(module.split(".")[:n]) or None


def _worst(findings):
    best = None
    for f in findings:
        if best is None or _RANK.get(f.severity, 9) < _RANK.get(best.severity, 9):
            best = f
    return best


def _finish(graph, group: Group, by_node: dict, own: dict) -> Group:
    group.n_ops = sum(1 for n in group.members if graph.nodes[n]["kind"] == "op")
    group.saved_bytes = sum(own.get(n, 0) for n in group.members)
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


def finding_nodes(graph, finding) -> list:
    """The graph nodes a finding is drawn on: its node, and for an in-place hazard every other saver."""
    if finding.node is None or finding.node not in graph:
        return []
    if finding.kind == INPLACE_HAZARD:
        from gradscope.checks.inplace import stale_savers

        return stale_savers(graph, finding.node)
    return [finding.node]


def cut_site(graph, finding, order=None) -> tuple[dict | None, str | None]:
    """A ``detached-branch`` finding's cut event (from ``trace()``) and the op it sits before.

    The op is the first node of the graph created after the cut (a later sequence number) that reads the
    cut value (when the trace recorded which ops did: a random wiring's next cell), in the module call
    where the cut was made (ResNet's residual add after a detached ``downsample``); else the first one.
    The drawing links the cut's octagon to it, and never folds or boxes it away.
    """
    events = [e for e in graph.graph.get(EVENTS, ()) if e.get("kind") != "inplace"]
    ev = next((e for e in events if set(finding.params) & set(e.get("params", ()))), None)
    if ev is None or not isinstance(ev.get("seq"), int):
        return ev, None
    after = [
        n for n in (forward_order(graph) if order is None else order) if (graph.nodes[n].get("seq") or -1) >= ev["seq"]
    ]
    # the ops that read the cut value, when trace() recorded them ("joins": ranges of sequence numbers)
    joins = ev.get("joins") or ()
    read = [n for n in after if any(a <= graph.nodes[n]["seq"] < b for a, b in joins)]
    after = read or after
    here = next((n for n in after if graph.nodes[n].get("module") == ev.get("module")), None)
    return ev, here if here is not None else next(iter(after), None)


def build_view(
    graph,
    findings=(),
    *,
    collapse=None,
    fold=True,
    min_reps: int = MIN_REPS,
    min_ops: int = MIN_OPS,
    module_of: dict | None = None,
    cache: dict | None = None,
    limit=None,
    chains: int | None = None,
    spans: bool = False,
) -> View:
    """Plan the drawing.

    Args:
        graph: ``report.graph``.
        findings: the report's findings (a box shows its worst one; a finding's node is never boxed).
        collapse: an int ``N`` draws module clusters down to depth ``N`` and every deeper module as one
            box; ``None`` or ``False``: no module is boxed.
        fold: fold unrolled repetition (at least ``min_reps`` repetitions over ``min_ops`` ops) into
            "xN" boxes.
        module_of: node -> module, when the caller has it (default :func:`infer_modules`).
        cache: a dict kept between calls on the same graph and findings (fold runs are found once).
        limit: ignored (the automatic choice moved to :mod:`gradscope.views.fit`); kept for callers.
        chains: draw every chain of at least this many ops (one op feeding the next, nothing else in
            between, same module) as one box ("chain:nK"); ``None``: never.
        spans: inside a module kept open for a finding, draw each run of its sub-module calls that holds
            no finding as one box (NOTE [runs of calls]), not one box per call.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        from gradscope.errors import InputValueError

        raise InputValueError(f"limit must be a positive int (a node count), got {one_line(limit)}.")
    order = forward_order(graph)
    module_of = infer_modules(graph, order) if module_of is None else module_of
    by_node: dict = {}
    protected: set = set()
    for f in findings:
        for n in finding_nodes(graph, f):
            by_node.setdefault(n, []).append(f)
            protected.add(n)
        if f.kind == DETACHED_BRANCH:
            site = cut_site(graph, f, order)[1]
            if site is not None:
                protected.add(site)
    keep_open = {truncate(module_of.get(n), k) for n in protected for k in range(1, depth(module_of.get(n)) + 1)}
    roots = {n for n, d in graph.nodes(data=True) if d.get("root")}
    owner: dict = {}
    groups: dict = {}
    if fold:
        key = ("runs", min_reps, min_ops)
        if cache is None or key not in cache:
            runs = fold_runs(graph, order, module_of, protected, min_reps, min_ops)
            if cache is not None:
                cache[key] = runs
        else:
            runs = cache[key]
        for run in runs:
            g = _fold_group(graph, order, module_of, roots, run)
            groups[g.gid] = g
            for n in g.members:
                owner[n] = g.gid
    _absorb_leaves(graph, owner, groups)
    depth_kept = None if collapse is None or collapse is False else int(collapse)
    if depth_kept is not None:
        _dissolve_boxed_folds(owner, groups, depth_kept, keep_open)
        _box_modules(order, module_of, owner, groups, roots | protected, depth_kept, keep_open, spans)
    if chains:
        _chains(graph, order, module_of, owner, groups, roots | protected, chains)
    _absorb_leaves(graph, owner, groups)
    from gradscope.graph.attribution import node_bytes

    own = node_bytes(graph)
    for g in groups.values():
        _finish(graph, g, by_node, own)
        if g.kind in ("fold", "chain") and depth_kept is not None:
            g.module = _open_ancestor(g.module, depth_kept, keep_open)
    return View(module_of, owner, groups, depth_kept, keep_open=keep_open)


def _box_modules(order, module_of, owner, groups, fixed, depth_kept, keep_open, spans) -> None:
    """Every module deeper than ``depth_kept`` (and not kept open) as one box per call; ``fixed`` nodes
    (roots, findings' nodes) stay drawn as themselves."""
    calls: dict = {}
    last = None  # (box, gid, parent module) of the previous op in forward order
    for n in order:
        m = module_of.get(n)
        box = None
        if not (n in owner or n in fixed or depth(m) <= depth_kept):
            k = depth_kept + 1  # the module holding a finding stays open
            while k <= depth(m) and truncate(m, k) in keep_open:
                k += 1
            box = truncate(m, k) if k <= depth(m) else None
        if box is None:
            last = None
            continue
        # NOTE [one box per call]: a box holds one contiguous run of ops in forward order (a module
        # called twice, like torchvision's shared ReLU, gets one box per call); contracting a
        # contiguous run cannot create a cycle (NOTE [folding repetition]).
        # NOTE [runs of calls]: with `spans`, consecutive calls of sibling modules inside a module
        # opened for a finding share one box ("denselayer1 - denselayer9"): a dense block whose every
        # layer reads every earlier one draws as a few boxes around the finding's layer, not 48 boxes
        # joined by 1,128 edges. Still one contiguous run of the forward order.
        parent = truncate(box, depth(box) - 1)
        if spans and last is not None and last[0] != box and last[2] == parent and depth(box) > depth_kept + 1:
            grp = groups[last[1]]  # NOTE [runs of calls]
            grp.title = f"{grp.module} \u2013 {box.rpartition('.')[2]}"
            grp.reps += 1
            last = (box, last[1], parent)
        elif last is None or last[0] != box:
            calls[box] = calls.get(box, 0) + 1
            gid = f"module:{box}" if calls[box] == 1 else f"module:{box}#{calls[box]}"
            groups[gid] = Group(gid, "module", box, box)
            last = (box, gid, parent)
        groups[last[1]].members.append(n)
        owner[n] = last[1]


def _dissolve_boxed_folds(owner: dict, groups: dict, depth_kept: int, keep_open: set) -> None:
    """A fold inside a module that is drawn as one box goes into that box: NOTE [boxes over folds]."""
    # NOTE [boxes over folds]: a fold sits in the module all its repetitions share (their common prefix);
    # when that module is boxed at this depth, the box holds the fold's ops too. Left as a fold, it would
    # cut the module's box into one box per stretch between folds (a random wiring: 89 boxes at depth 0
    # where its three stages are three boxes).
    for gid, g in list(groups.items()):
        k = depth_kept + 1
        while k <= depth(g.module) and truncate(g.module, k) in keep_open:
            k += 1
        if g.kind == "fold" and k <= depth(g.module):
            for n in g.members:
                owner.pop(n, None)
            del groups[gid]


def _fold_group(graph, order, module_of, roots, run) -> Group:
    start, period, reps = run.start, run.period, run.reps
    members = [n for n in order[start : start + period * reps] if n not in roots]
    mod = module_of.get(members[0])
    for n in members[1:]:
        mod = lcp(mod, module_of.get(n))
    names = tuple(graph.nodes[n]["name"] for n in order[start : start + period])
    g = Group(f"fold:{order[start]}", "fold", f"x{reps}", mod, members, reps=reps, pattern=names, cls=run.cls)
    g.calls = run.calls
    if run.first is not None or run.last is not None:
        g.span = (run.first or "", run.last or "")
    else:
        ends = [truncate(module_of.get(n), depth(mod) + 1) for n in (members[0], members[-1])]
        if all(ends) and ends[0] != ends[1]:
            g.span = tuple(ends)
    return g


def fold_lines(grp: Group) -> list[str]:
    """What a fold box says: what repeats (the module's class and its calls, when traced), then the ops."""
    first, last = grp.span or ("", "")
    ops = ", ".join(x.replace("Backward0", "") for x in grp.pattern[:3]) + (", ..." if len(grp.pattern) > 3 else "")
    if grp.cls and first == last:  # one module called again and again (an unrolled RNN cell)
        a, b = grp.calls
        return [f"{grp.title} {grp.cls}  ({first}, calls {a}\u2013{b})", f"{len(grp.pattern)} ops each: {ops}"]
    if grp.cls:
        return [f"{grp.title} {grp.cls}  ({first} \u2013 {last})", f"{len(grp.pattern)} ops each: {ops}"]
    span = [f"{first} \u2013 {last}"] if grp.span else []
    return [f"{grp.title}  repeated block ({len(grp.pattern)} ops each)", ops] + span


def _open_ancestor(module, depth_kept, keep_open):
    """The deepest ancestor of ``module`` drawn as a cluster."""
    k = depth_kept
    while k < depth(module) and truncate(module, k + 1) in keep_open:
        k += 1
    return truncate(module, k)
