"""Repeated blocks along module calls: which runs of the forward order the drawing folds into one ``xN`` box.

NOTE [folding whole calls]
A repetition is a run of sibling module calls (children of one call, one after the other) with the same
structure: the same ops, in the same sub-modules (names relative to the call), with the same output
and parameter shapes, each call reading what the one before it made (parallel branches are not
repetition). Each call's *unit* also holds the ops its parent runs after it, up to the next sibling (ResNet's
residual add and ReLU when they are not inside the block), so a fold covers whole calls and never the
tail of one block plus the head of the next. Shapes are part of the structure, so stages of different
widths never merge. On a traced graph the calls are ``graph.graph["module_calls"]`` (NOTE [module
calls]): two calls of the same module stay two calls. Without them (no trace, or an older file) the
calls are the runs of ops whose module (NOTE [inferring modules]) shares a prefix. A unit holding a node
that must stay visible (a finding's node, the op right after a cut) is never folded: the run is split
around it and that call is searched for repetition inside it like any call not folded. Ops that sit in
a call but in none of its sub-calls are folded by period (NOTE [folding repetition]), within that
stretch only, so no period-based fold crosses a module boundary either. Every fold is one contiguous
interval of the forward order, so contracting it cannot create a cycle.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from gradscope.graph import MODULE_CALLS
from gradscope.views.folds import find_folds, tokens

__all__ = ["CALL_REPS", "CALL_OPS", "Call", "Fold", "call_tree", "fold_runs"]

#: Whole module calls fold from this many repetitions on (the label names what repeats, so even two
#: identical blocks read better as one box); repetition by period needs the caller's ``min_reps``.
CALL_REPS = 2
CALL_OPS = 8


@dataclass(slots=True)
class Call:
    """One module call over positions ``[lo, hi)`` of the forward order."""

    name: str | None
    cls: str | None
    lo: int
    hi: int
    children: list = field(default_factory=list)
    number: int = 1  # the how-manieth call of this module (an unrolled cell: 1, 2, 3, ...)


@dataclass(frozen=True, slots=True)
class Fold:
    """``reps`` repetitions of ``period`` ops from position ``start``; ``what``: class and call names."""

    start: int
    period: int
    reps: int
    cls: str | None = None
    first: str | None = None
    last: str | None = None
    calls: tuple[int, int] = (1, 1)  # call numbers of the first and last repetition


def _traced_tree(graph, order, rows) -> Call | None:
    seqs = []
    for n in order:
        s = graph.nodes[n].get("seq")
        seqs.append(float("inf") if s is None else s)
    root = Call(None, None, 0, len(order))
    calls: list = []
    for row in rows:
        if not (isinstance(row, (list, tuple)) and len(row) == 5 and isinstance(row[1], int)):
            return None  # not written by trace(): fall back to module names
        name, parent, cls, first, end = row
        lo, hi = bisect_left(seqs, first), bisect_left(seqs, end)
        call = Call(name or None, cls, lo, hi)
        calls.append(call)
        if lo < hi:
            (calls[parent] if 0 <= parent < len(calls) - 1 else root).children.append(call)
    if len(root.children) == 1 and root.children[0].name is None:  # the model's own call
        return root.children[0]
    return root


def _named_tree(order, module_of) -> Call:
    """Calls as runs of ops sharing a module prefix (see NOTE [folding whole calls])."""
    root = Call(None, None, 0, len(order))
    stack: list = []  # open calls, outermost first
    for i, n in enumerate(order):
        parts = (module_of.get(n) or "").split(".") if module_of.get(n) else []
        names = [".".join(parts[: k + 1]) for k in range(len(parts))]
        keep = 0
        while keep < len(stack) and keep < len(names) and stack[keep].name == names[keep]:
            keep += 1
        for c in stack[keep:]:
            c.hi = i
        del stack[keep:]
        for name in names[keep:]:
            c = Call(name, None, i, len(order))
            (stack[-1] if stack else root).children.append(c)
            stack.append(c)
    return root


def call_tree(graph, order, module_of) -> Call:
    """The module calls over ``order`` (the forward order of ops), under one root call."""
    rows = graph.graph.get(MODULE_CALLS)
    tree = _traced_tree(graph, order, rows) if rows else None
    tree = tree if tree is not None else _named_tree(order, module_of)
    seen: dict = {}
    stack = [tree]
    while stack:  # number the calls of each module, in forward order
        call = stack.pop()
        if call.name is not None:
            call.number = seen[call.name] = seen.get(call.name, 0) + 1
        stack.extend(reversed(call.children))
    return tree


def _rel(module, name, parent):
    m = module or ""
    for base, tag in ((name, "."), (parent, "^")):
        if base and (m == base or m.startswith(base + ".")):
            return tag + m[len(base) :]
    return "=" + m


def _signature(graph, order, module_of, lo, hi, name, parent):
    """Per op: its name, module (relative), output shape and the shapes of the parameters it reads."""
    nodes, out = graph.nodes, []
    for n in order[lo:hi]:
        d = nodes[n]
        shapes = d.get("out_shapes") or [None]
        params = sorted(str(nodes[p].get("shape")) for p in graph.predecessors(n) if nodes[p]["kind"] != "op")
        out.append((d["name"], _rel(module_of.get(n), name, parent), str(shapes[0]), bool(d.get("root")), *params))
    return tuple(out)


def _feeds(graph, order, a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether an op in positions ``b`` reads an op in positions ``a``: one repetition feeds the next."""
    first = set(order[a[0] : a[1]])
    return any(p in first for n in order[b[0] : b[1]] for p in graph.predecessors(n))


def _gaps(call: Call) -> list[tuple[int, int]]:
    """After each child, the call's own ops up to the next child (the last: to the call's end)."""
    kids = call.children
    return [(c.hi, kids[i + 1].lo if i + 1 < len(kids) else call.hi) for i, c in enumerate(kids)]


def _loose(call: Call) -> list[tuple[int, int]]:
    """Stretches of the call's own ops before its first child (the rest sit in the units)."""
    if not call.children:
        return [(call.lo, call.hi)]
    return [(call.lo, call.children[0].lo)] if call.children[0].lo > call.lo else []


def fold_runs(graph, order, module_of, protected, min_reps: int, min_ops: int) -> list[Fold]:
    """The folds of the drawing (NOTE [folding whole calls]), left to right."""
    toks = tokens(graph, order, module_of)
    out: list[Fold] = []
    stack = [call_tree(graph, order, module_of)]
    while stack:  # explicit stack: no recursion
        call = stack.pop()
        for lo, hi in _loose(call):
            out.extend(_periodic(toks[lo:hi], order, lo, protected, min_reps, min_ops))
        kids, gaps = call.children, _gaps(call)
        csig = [_signature(graph, order, module_of, c.lo, c.hi, c.name, call.name) for c in kids]
        gsig = [_signature(graph, order, module_of, a, b, None, call.name) for a, b in gaps]
        i = 0
        while i < len(kids):
            gap, j = gsig[i], i + 1  # with no ops between the calls, the last one's own gap may differ
            while (
                j < len(kids)
                and csig[j] == csig[i]
                and gsig[j - 1] == gap
                and (not gap or gsig[j] == gap)
                and _feeds(graph, order, (kids[j - 1].lo, gaps[j - 1][1]), (kids[j].lo, kids[j].hi))
            ):
                j += 1
            units = [(kids[k].lo, gaps[k][1] if gap else kids[k].hi) for k in range(i, j)]
            folded = set()
            if j - i >= min(min_reps, CALL_REPS) and sum(b - a for a, b in units) >= min(min_ops, CALL_OPS):
                folded = _split(units, kids, i, order, protected, out)
            stack.extend(kids[k] for k in range(i, j) if k not in folded)
            i = j
    out.sort(key=lambda f: f.start)
    return out


def _split(units, kids, i, order, protected, out) -> set:
    """Fold ``units`` (of children ``i``, ``i + 1``, ...) around those holding a protected node; the
    indices folded."""
    j = i + len(units)
    hit = [k for k in range(i, j) if any(order[p] in protected for p in range(*units[k - i]))]
    folded: set = set()
    lo = i
    for k in hit + [j]:
        if k - lo >= 2:
            a, b = units[lo - i]
            first, last = kids[lo], kids[k - 1]
            out.append(Fold(a, b - a, k - lo, first.cls, first.name, last.name, (first.number, last.number)))
            folded.update(range(lo, k))
        lo = k + 1
    return folded


def _periodic(toks, order, offset, protected, min_reps, min_ops):
    for start, period, reps in find_folds(toks, min_reps, min_ops):
        base = offset + start
        hit = sorted({(p - base) // period for p in range(base, base + period * reps) if order[p] in protected})
        lo = 0
        for k in hit + [reps]:
            if k - lo >= 2:
                yield Fold(base + lo * period, period, k - lo)
            lo = k + 1
