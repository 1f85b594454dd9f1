"""Which module owns each node of ``report.graph`` (NOTE [inferring modules]), one answer for the picture and
``memory()`` alike.
"""

from __future__ import annotations

from collections.abc import Iterable

import networkx as nx

from gradscope._format import lcp
from gradscope.graph.queries import forward_order, param_storages
from gradscope.graph.schema import CALLED_MODULES, OP, PARAM

__all__ = ["is_traced", "node_modules"]

# NOTE [inferring modules]
# A traced graph (trace=) carries `module` on op nodes; we use it as is, None included (an op outside every
# module, such as the loss). A parameter node's module comes from its qualified name. Without a trace an
# op is *anchored* to the longest common dotted prefix of the modules of the parameters it uses: consumed
# directly (AccumulateGrad -> AddmmBackward0), through a parameter-only view (TBackward0 of `a.weight`),
# or saved by storage (LayerNorm's weight, mm's weight.t()). Every other op takes the common prefix of the
# nearest anchored ops before and after it in forward order: the attention matmuls between
# `blocks.0.attn.qkv` and `blocks.0.attn.proj` land in `blocks.0.attn`, a residual add between
# `layers.0.attn.proj` and `layers.0.norm` in `layers.0`, the loss after the last module in no module.
# One exception: a view (ViewBackward0, UnsafeViewBackward0) next to an anchored mm/addmm in forward order
# (at most 2 apart) and linked to it by an edge takes the mm's module: F.linear on a 3-d input reshapes
# before and after its addmm, inside the Linear.
# This mimics the trace's sequence-range attribution
# (docs/internals.md#module-attribution-by-sequence-ranges) without hooks;
# tests/walk/test_graph.py checks it against trace() on real models.


def is_traced(graph: nx.DiGraph) -> bool:
    """True when module names on op nodes come from ``trace()``."""
    return CALLED_MODULES in graph.graph or any(
        d.get("module") for _, d in graph.nodes(data=True) if d.get("kind") == OP and not d.get("region")
    )


#: How far (in forward order) a reshaping op may sit from the anchor it is glued to, and which ops glue:
#: the views that F.linear / matmul put around their mm on inputs of more than two dimensions.
_GLUE = 2
_VIEWS = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})
_MATMULS = frozenset({"AddmmBackward0", "MmBackward0"})


def _common(mods: Iterable[str]) -> str | None:
    out = None
    for i, m in enumerate(sorted(mods)):
        out = m if i == 0 else lcp(out, m)
    return out


def _anchors(graph: nx.DiGraph, order: list[str]) -> dict[str, str]:
    """Op node -> module, for the ops that use parameters (see NOTE [inferring modules])."""
    nodes = graph.nodes
    pred = graph.pred
    by_storage = param_storages(graph)
    via: dict[str, set] = {}  # leaf or parameter-only view (weight.t()) -> its modules
    for nid, d in nodes(data=True):
        if d["kind"] == PARAM:
            via[nid] = {d["module"]} if d.get("module") else set()
    for nid in order:
        d = nodes[nid]
        if not d["saved"] and pred[nid] and all(nodes[w]["kind"] == PARAM for w in pred[nid]):
            via[nid] = {nodes[w]["module"] for w in pred[nid] if nodes[w].get("module")}
    out = {}
    for nid in order:
        mods: set = set()
        for u in pred[nid]:
            mods.update(via.get(u, ()))
        if by_storage:
            for e in nodes[nid]["saved"]:
                mods.update(by_storage.get(e.get("storage"), ()))
        m = _common(mods)
        if m:
            out[nid] = m
    rank = {n: i for i, n in enumerate(order)}
    succ = graph.succ
    glued = {}
    for nid in order:  # the views F.linear makes around its mm belong to the Linear
        if nid in out or nodes[nid]["name"] not in _VIEWS:
            continue
        near = [
            m
            for m in (*pred[nid], *succ[nid])
            if m in out and nodes[m]["name"] in _MATMULS and abs(rank[m] - rank[nid]) <= _GLUE
        ]
        if near:
            glued[nid] = out[min(near, key=lambda m: (abs(rank[m] - rank[nid]), -rank[m]))]
    out.update(glued)
    return out


def node_modules(graph: nx.DiGraph, order: list[str] | None = None) -> dict[str, str | None]:
    """The module owning every node (``None``: no module); see NOTE [inferring modules].

    Args:
        graph: ``report.graph``.
        order: :func:`forward_order` of the graph, when the caller already has it.

    Returns:
        ``{node id: module name or None}`` for every node, ops and leaves.

    Example:
        >>> import torch, gradscope
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        >>> report = gradscope.inspect(net(torch.randn(2, 3)).sum(), model=net)
        >>> sorted({(d["name"], m) for n, m in node_modules(report.graph).items()
        ...         for d in [report.graph.nodes[n]] if d["kind"] == "op"}, key=str)   # doctest: +NORMALIZE_WHITESPACE
        [('AddmmBackward0', '0'), ('AddmmBackward0', '2'), ('ReluBackward0', None), ('SumBackward0', None),
         ('TBackward0', '0'), ('TBackward0', '2')]
    """
    nodes = graph.nodes
    out = {n: d.get("module") for n, d in nodes(data=True)}
    if is_traced(graph):
        return out
    # a compiled region's box and ops, drawn by gradscope.views.regions, keep their module
    boxed = {n: d["module"] for n, d in nodes(data=True) if d.get("region")}
    order = forward_order(graph) if order is None else order
    tagged = _anchors(graph, order)
    before: dict = {}
    last: str | None = None
    seen_tag = False
    for n in order:
        if n in tagged:
            last, seen_tag = tagged[n], True
        else:
            before[n] = last if seen_tag else None
    nxt: str | None = None
    for n in reversed(order):
        if n in tagged:
            nxt = out[n] = tagged[n]
        else:
            out[n] = lcp(before[n], nxt)
    out.update(boxed)
    return out
