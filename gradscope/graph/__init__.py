"""The schema of ``report.graph`` and the questions every reader asks of it, answered once.

``report.graph`` is a ``networkx.DiGraph`` of plain metadata built by the walk (:mod:`gradscope.walk`):
an edge ``u -> v`` means ``v`` consumed ``u``'s output. This module is the one place that says what its
attributes are (:class:`NodeAttrs`, :class:`SavedEntry`, :class:`EdgeAttrs`, :class:`GraphAttrs`, the
key constants) and the one implementation of the shared queries:

- :func:`held_bytes`: saved bytes, each storage counted once;
- :func:`forward_order`: op nodes in forward creation order;
- :func:`node_modules`: which module owns each node (NOTE [inferring modules]);
- :func:`storage_uses`: every saved storage once, with its owner (NOTE [one storage, one owner]).

The package, by question:

- :mod:`~gradscope.graph.schema`: the TypedDicts, node kinds, slot states and ``graph.graph`` keys;
- :mod:`~gradscope.graph.queries`: held bytes, forward order, storages;
- :mod:`~gradscope.graph.modules`: module ownership;
- :mod:`~gradscope.graph.attribution`: bytes per node and per module (``memory()``, the picture);
- :mod:`~gradscope.graph.validation`: a saved report checked against the schema on load.

Everything here reads only the metadata graph, so it works the same on a report loaded back from JSON.
It imports nothing from gradscope but :mod:`gradscope._format`, :mod:`gradscope.errors` and
:mod:`gradscope.findings`: the walk, the checks, memory and the views all depend on it, never the other
way round. This module re-exports the names, so ``from gradscope.graph import X`` keeps working.

Example:
    >>> import torch, gradscope
    >>> from gradscope.graph import OP, ROOTS, forward_order
    >>> x = torch.randn(3, requires_grad=True)
    >>> g = gradscope.inspect((x.exp() * 2).sum()).graph
    >>> [g.nodes[n]["name"] for n in forward_order(g)], g.nodes[g.graph[ROOTS][0]]["kind"] == OP
    (['ExpBackward0', 'MulBackward0', 'SumBackward0'], True)
"""

from __future__ import annotations

from gradscope.graph import modules, queries, schema
from gradscope.graph.modules import *  # noqa: F403 - the package's face: every public name of its modules
from gradscope.graph.queries import *  # noqa: F403
from gradscope.graph.schema import *  # noqa: F403

__all__ = [*schema.__all__, *queries.__all__, *modules.__all__]
