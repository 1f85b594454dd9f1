"""Finding repetition and chains in the forward order of ops: the pure string work behind ``build_view``.

See NOTE [folding repetition] and NOTE [chains].
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["MIN_REPS", "MIN_OPS", "MAX_PERIOD", "tokens", "find_folds", "chains"]

# NOTE [folding repetition]
# Ops sorted by `seq` form a token string (op name + module with indices replaced by '#'). A run where the
# string repeats with period p at least MIN_REPS times (and covers at least MIN_OPS ops) is contracted into
# one box labelled "xN". Contracting a contiguous `seq` interval cannot create a cycle: data flows from
# lower to higher `seq`, so a path that leaves the interval never comes back into it.

MIN_REPS = 4
MIN_OPS = 24
MAX_PERIOD = 160
_DIGITS = re.compile(r"\d+")

# NOTE [chains]
# A chain is a run of ops where each feeds only the next and the next reads only it (leaves aside), all
# in one module. Nothing enters or leaves a chain in its middle, so drawing it as one box cannot create
# a cycle. The default drawing boxes chains only as a last resort (gradscope.views.fit).


@dataclass(slots=True)
class Group:
    """A box drawn in place of many nodes."""

    gid: str
    kind: str  # "module" (collapsed module) or "fold" (repetition)
    title: str
    module: str | None  # where the box sits (its cluster); for a module box, the module itself
    members: list = field(default_factory=list)
    n_ops: int = 0
    saved_bytes: int = 0
    reps: int = 1
    pattern: tuple = ()
    worst: object = None  # the most severe Finding inside, or None
    span: tuple = ()  # (first, last) module a fold runs over, e.g. ("layers.0", "layers.94")
    cls: str | None = None  # a fold of whole module calls: the class of the module repeated
    calls: tuple = (1, 1)  # ... and the call numbers of its first and last repetition


def tokens(graph, order, module_of) -> list[int]:
    """One int per op in ``order``: equal for the same op name in the same module up to indices."""
    ids: dict = {}
    out = []
    for n in order:
        d = graph.nodes[n]
        key = (d["name"], _DIGITS.sub("#", module_of.get(n) or ""), bool(d.get("root")))
        out.append(ids.setdefault(key, len(ids)))
    return out


def find_folds(
    tokens: list[int], min_reps: int = MIN_REPS, min_ops: int = MIN_OPS, max_period: int = MAX_PERIOD
) -> list[tuple[int, int, int]]:
    """Runs of repetition in ``tokens``: ``(start, period, reps)``, non-overlapping, left to right."""
    n = len(tokens)
    periods = range(1, min(max_period, n // max(min_reps, 1)) + 1)
    match = {}
    for p in periods:  # match[p][i]: how far t[j] == t[j+p] holds from i on
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


def chains(graph, order, module_of, owner, groups, fixed, min_len) -> None:
    """Box every chain of at least ``min_len`` loose ops (not in ``owner``, not in ``fixed``): NOTE [chains]."""
    nodes = graph.nodes

    def op_preds(n):
        return [p for p in graph.predecessors(n) if nodes[p]["kind"] == "op"]

    def op_succs(n):
        return [c for c in graph.successors(n) if nodes[c]["kind"] == "op"]

    loose = [n for n in order if n not in owner and n not in fixed]
    free = set(loose)
    done: set = set()
    for n in loose:
        if n in done:
            continue
        run = [n]
        while True:
            succ = op_succs(run[-1])
            if len(succ) != 1 or succ[0] not in free or succ[0] in done:
                break
            nxt = succ[0]
            if op_preds(nxt) != [run[-1]] or module_of.get(nxt) != module_of.get(n):
                break
            run.append(nxt)
        done.update(run)
        if len(run) >= min_len:
            gid = f"chain:{run[0]}"
            g = Group(
                gid,
                "chain",
                f"{len(run)} ops",
                module_of.get(n),
                list(run),
                pattern=tuple(nodes[m]["name"] for m in run),
            )
            groups[gid] = g
            for m in run:
                owner[m] = gid
