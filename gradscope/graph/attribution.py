"""Who owns each saved storage and which module owns each node: the pure helpers behind ``memory()``.

Everything here reads only the metadata graph, so it works the same on a report loaded back from JSON.
The renderer may import :func:`node_bytes` and :func:`module_bytes` to shade nodes and module clusters.

NOTE [one storage, one owner]
A storage saved by several nodes (``x`` saved by two Linear layers, the output of ``relu`` saved by the
next ``addmm``, two views of one tensor) is counted once, and attributed to the first node that saved it
in forward creation order (the autograd sequence number, ``seq``; ties and leaves by node id). Its byte
count is the whole storage (``untyped_storage().nbytes()``), not the view's ``numel * itemsize``: that is
what the graph keeps alive. Categories, one per storage:
    params     held (live/stale/hooked) and the storage of a named parameter: saved by reference, it costs
               no memory beyond the parameter itself (``weight.t()`` in mm/addmm, LayerNorm's weight).
    held       held and not a parameter: activation memory that backward() frees.
    offloaded  only ever saved under ``save_on_cpu``: ``nbytes`` is the CPU copy.
If one slot holds a storage and another offloaded it, it is held (that is what ``report.saved_bytes``
counts). Wrapped Python scalars (``x * 2``) are left out, like in ``report.saved_bytes``; entries without
a storage id (sparse tensors) are counted one by one. Recomputed (checkpoint) slots hold nothing and are
only counted.
"""

from __future__ import annotations

from gradscope.graph.modules import node_modules as _node_modules
from gradscope.graph.queries import StorageUse, forward_order, storage_uses
from gradscope.graph.schema import HELD

__all__ = ["NO_MODULE", "HELD", "StorageUse", "seq_order", "storage_uses", "node_modules", "node_bytes", "module_bytes"]

#: The group name of op nodes that no module can be found for.
NO_MODULE = "(no module)"

#: Op node ids in forward creation order (the one implementation: :func:`gradscope.graph.forward_order`).
seq_order = forward_order


def node_modules(graph) -> dict[str, str]:
    """The module of every op node, :data:`NO_MODULE` when none (see :func:`gradscope.graph.node_modules`)."""
    return {n: m or NO_MODULE for n, m in _node_modules(graph).items() if graph.nodes[n]["kind"] == "op"}


def node_bytes(graph, *, params: bool = False) -> dict[str, int]:
    """Saved bytes each op node is the owner of (each storage counted once, at its first saver).

    Args:
        graph: ``report.graph``.
        params: also count parameters saved by reference (they cost no extra memory).

    Returns:
        ``{node id: bytes}`` for the op nodes that own at least one held storage.

    Example:
        >>> node_bytes(report.graph)              # doctest: +SKIP
        {'n1': 1280, 'n2': 1400, ...}
    """
    out: dict[str, int] = {}
    for use in storage_uses(graph):
        if use.category == "held" or (params and use.category == "params"):
            out[use.owner] = out.get(use.owner, 0) + use.nbytes
    return out


def module_bytes(graph, *, params: bool = False) -> dict[str, int]:
    """Activation bytes held per module (see :func:`node_modules` and :func:`node_bytes`).

    Returns:
        ``{module name: bytes}``, largest first; op nodes without a module count under :data:`NO_MODULE`.
        The values sum to ``report.saved_bytes`` when ``params=True``.

    Example:
        >>> module_bytes(report.graph)            # doctest: +SKIP
        {'linear1': 2560, 'self_attn': 1280, '(no module)': 640}
    """
    mods = node_modules(graph)
    out: dict[str, int] = {}
    for nid, n in node_bytes(graph, params=params).items():
        m = mods.get(nid, NO_MODULE)
        out[m] = out.get(m, 0) + n
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))
