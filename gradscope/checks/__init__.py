"""Checks: free functions over the metadata graph, one topic per module.

Each module exposes ``check(graph, nodes=None) -> Iterator[Finding]`` (``nodes``: see
:func:`~gradscope.checks._nodes.node_items`). They read only the graph (and the plain data
that :func:`gradscope.inspect` stored in ``graph.graph``), never live tensors, so they run the same on a
report loaded back from JSON.
"""

from __future__ import annotations

from gradscope.checks import compiled, freed, inplace, roots, unused
from gradscope.findings import Finding, sort_findings

__all__ = ["CHECKS", "run_checks"]

CHECKS = (roots.check, unused.check, inplace.check, freed.check, compiled.check)


def run_checks(graph, nodes=None):
    """Run every check and return the findings, most severe first (deterministic order).

    ``nodes``: the only node ids that can hold a non-live saved slot or be opaque (``inspect`` knows
    them from its walk); None (a graph loaded from JSON, say) looks at every node.
    """
    out: list[Finding] = []
    for check in CHECKS:
        out.extend(check(graph, nodes))
    return sort_findings(out)
