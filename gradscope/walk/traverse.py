"""The one bounded traversal of a live autograd graph, for the code that must look at it while it lives
(``trace()``'s cut events, ``watch()``'s per-step checks and hooks). ``inspect()`` has its own loop
(``loop.py``), which reads every node as it goes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = ["NODE_LIMIT", "traverse"]

Node = torch.autograd.graph.Node

#: The default bound: a traversal stops after this many nodes (a graph this large is read by ``inspect``).
NODE_LIMIT = 200_000


def traverse(starts: Iterable[Node | None], visit: Callable[[Node], bool], limit: int = NODE_LIMIT) -> list[Node]:
    """Visit each node reachable from ``starts`` once, depth-first, at most ``limit`` nodes.

    Args:
        starts: the nodes to start from (``None`` entries are skipped).
        visit: called once per node; it returns whether to go on into the node's inputs
            (``next_functions``).
        limit: the most nodes visited.

    Returns:
        The visited nodes in visit order (root first). The caller decides how long to keep them: they
        keep the graph alive, and a deep one must be released root-first (NOTE [freeing deep graphs]).
    """
    seen: set[Node] = set()
    order: list[Node] = []
    stack = [n for n in starts if n is not None]
    while stack and len(order) < limit:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        if visit(node):
            stack.extend(m for m, _ in node.next_functions if m is not None and m not in seen)
    return order
