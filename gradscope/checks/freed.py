"""``freed-graph``: the saved tensors were released by an earlier backward."""

from __future__ import annotations

from collections.abc import Iterator

from gradscope.findings import Finding
from gradscope.checks._nodes import node_items

__all__ = ["check"]


def check(graph, nodes=None) -> Iterator[Finding]:
    """One info finding when any saved slot was freed by a backward without ``retain_graph=True``."""
    freed = [n for n, d in node_items(graph, nodes) if any(e["status"] == "freed" for e in d["saved"])]
    if not freed:
        return
    first = freed[0]
    yield Finding(
        "freed-graph", "info",
        f"{len(freed)} node(s) (first: {graph.nodes[first]['name']}) already had their saved tensors freed "
        "by a backward() without retain_graph=True: the structure is shown, but their saved bytes are gone "
        "and a second backward() through them raises. Inspect before backward(), or pass "
        "retain_graph=True to the first backward if you really need two.",
        node=first)
