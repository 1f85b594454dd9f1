"""``freed-graph``: the saved tensors were released by an earlier backward."""

from __future__ import annotations

from collections.abc import Iterator

from gradscope.checks._nodes import node_items
from gradscope.checks._words import op_words
from gradscope.findings import ERROR, FREED_GRAPH, Finding

__all__ = ["check"]


def check(graph, nodes=None) -> Iterator[Finding]:
    """One error when any saved slot was freed by a backward without ``retain_graph=True``.

    Every node of the graph is reachable from the roots, so backward() from them runs the freed node
    and raises 'Trying to backward through the graph a second time'.
    """
    freed = [n for n, d in node_items(graph, nodes) if any(e["status"] == "freed" for e in d["saved"])]
    if not freed:
        return
    first = graph.nodes[freed[0]]
    where = f" in {first['module']}" if first.get("module") else ""
    yield Finding(
        FREED_GRAPH,
        ERROR,
        f"{len(freed)} node(s) of this graph (first: {op_words(first['name'])}{where}, {freed[0]}) had their "
        "saved tensors freed by an earlier backward(): backward() through it raises 'Trying to backward "
        "through the graph a second time'. If a tensor from the previous step is carried into this one "
        "(an RNN hidden state, a running total, a graph built once in __init__), .detach() it at the step "
        "boundary (or rebuild it every step); only if you really need two backward passes through one "
        "graph, pass retain_graph=True to the first.",
        node=freed[0],
        location=first.get("location"),  # traced: the line that made that node
    )
