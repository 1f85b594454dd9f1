"""Wrapping a tall drawing into columns: a long chain of blocks read top to bottom, then the next column.

NOTE [wrapping columns]
A model that is one long chain of wide-ish blocks (Inception's eleven blocks of parallel branches) lays
out tall and thin: within the page's longer side but past its aspect ratio, and LR only makes it as
wide. Folding cannot help when the blocks differ. The drawing is then cut into ``k`` columns along the
forward order: the elements (ops and boxes, each placed at its first op's sequence number; a leaf goes
with the op it feeds) are split into ``k`` runs of about equal size, at places where the top-level
module changes, so that no module cluster is cut in two. Edges that cross from one column to the next
stop constraining the ranks (``constraint=false``) and the first element of every column is put on one
rank, left to right, so the columns stand side by side. The aspect ratio drops about ``k**2`` times.
Only the ranks change: every element, edge, cluster and label stays as it was.
"""

from __future__ import annotations

from bisect import bisect_right

from gradscope.views.style import dot_id

__all__ = ["columns_for", "wrap"]


def columns_for(width: float, height: float, target: float = 1.5) -> int:
    """How many columns bring a ``width x height`` drawing near ``target`` height per width (at least 2)."""
    return max(2, round((height / max(width, 1.0) / target) ** 0.5))


def _top(cluster) -> str | None:
    return None if not cluster else cluster.split(".")[0]


def wrap(b, columns: int) -> None:
    """Re-rank the builder ``b``'s elements into ``columns`` columns (NOTE [wrapping columns])."""
    nodes = b.g.nodes
    key: dict = {}
    for n, eid in b.out.element_of.items():
        seq = nodes[n].get("seq") if n in nodes else None
        if seq is not None and eid in b.items:
            key[eid] = min(key.get(eid, seq), seq)
    for eid, to in b.beside.items():  # a leaf (parameter, input) goes with the op it feeds
        if eid not in key and to in key:
            key[eid] = key[to]
    for a, c in b.edges:  # a cut's octagon goes with the op after it
        if a not in key and c in key and a.startswith("cut:"):
            key[a] = key[c]
    main = sorted((k, e) for e, k in key.items() if e not in b.beside and not e.startswith("cut:"))
    if len(main) < 2 * columns:
        return
    col: dict = {}
    cuts = _cut_points([b.items[e][0] for _, e in main], columns)
    heads = []
    c = 0
    for i, (_, e) in enumerate(main):
        if i in cuts or i == 0:
            c += i in cuts
            heads.append(e)
        col[e] = c
    keys = [k for k, _ in main]
    for e, k in key.items():
        if e not in col:
            col[e] = col[main[max(0, bisect_right(keys, k) - 1)][1]]
    for (a, c2), attrs in list(b.edges.items()):
        if col.get(a, 0) != col.get(c2, 0):
            b.edges[(a, c2)] = dict(attrs or {}, constraint="false")
    names = [dot_id(b.names[h]) for h in heads]
    b.extra.append("\t{rank=same; " + "; ".join(names) + "}\n")
    b.extra.extend(f"\t{x} -> {y} [style=invis]\n" for x, y in zip(names, names[1:]))


def _cut_points(clusters: list, columns: int) -> set:
    """Indices where a new column starts: near equal shares, where the top-level module changes."""
    n = len(clusters)
    ok = [i for i in range(1, n) if _top(clusters[i]) != _top(clusters[i - 1]) or clusters[i] is None]
    out: set = set()
    for j in range(1, columns):
        want = round(n * j / columns)
        best = min((i for i in ok if i not in out), key=lambda i: abs(i - want), default=None)
        if best is not None:
            out.add(best)
    return out
