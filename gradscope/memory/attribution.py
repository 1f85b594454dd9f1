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

from dataclasses import dataclass, field
from functools import reduce

from gradscope._format import lcp
from gradscope.walk.saved import HELD

__all__ = ["NO_MODULE", "HELD", "StorageUse", "seq_order", "storage_uses", "node_modules", "node_bytes",
           "module_bytes"]

#: The group name of op nodes that no module can be found for.
NO_MODULE = "(no module)"


@dataclass(slots=True)
class StorageUse:
    """One saved storage, counted once (see NOTE [one storage, one owner])."""

    key: tuple
    nbytes: int
    category: str          # "held" | "params" | "offloaded"
    owner: str             # node id of the first node that saved it
    device: str | None     # the device it was saved from (for offloaded: the device it left)
    users: list[str] = field(default_factory=list)   # node ids that saved it, forward order


def seq_order(graph) -> list[str]:
    """Op node ids in forward creation order (``seq``); ties and unknown seqs keep node order."""
    big = float("inf")
    ops = [(n, d.get("seq")) for n, d in graph.nodes(data=True) if d.get("kind") == "op"]
    ops.sort(key=lambda ns: big if ns[1] is None else ns[1])   # stable: ties stay in node-id order
    return [n for n, _ in ops]


def _param_storages(graph) -> set:
    return {p["storage"] for p in graph.graph.get("params", {}).values() if p.get("storage") is not None}


def storage_uses(graph, order: list[str] | None = None) -> list[StorageUse]:
    """Every saved storage once, in the order its owner was created (see NOTE [one storage, one owner]).

    Args:
        graph: ``report.graph``.
        order: :func:`seq_order` of the graph, when the caller already has it.
    """
    params = _param_storages(graph)
    uses: dict[tuple, StorageUse] = {}
    nodes = graph.nodes
    for nid in seq_order(graph) if order is None else order:
        for i, e in enumerate(nodes[nid]["saved"]):
            status = e["status"]
            if e.get("scalar") or (status not in HELD and status != "offloaded"):
                continue
            sid = e["storage"]
            if status == "offloaded":
                cat = "offloaded"
            else:
                cat = "params" if sid is not None and sid in params else "held"
            key = ("s", sid) if sid is not None else ("e", nid, i)
            use = uses.get(key)
            if use is None:
                uses[key] = StorageUse(key, int(e["nbytes"]), cat, nid, e.get("device"), [nid])
                continue
            if nid not in use.users:
                use.users.append(nid)
            if use.category == "offloaded" and cat != "offloaded":
                use.category, use.owner, use.device = cat, nid, e.get("device")
    return list(uses.values())


def _owner_module(qualname: str) -> str | None:
    head, _, _ = qualname.rpartition(".")
    return head or None


def _common(mods: set[str]) -> str | None:
    """Longest common dotted prefix of the modules; the first one (sorted) when they share nothing."""
    if not mods:
        return None
    ordered = sorted(mods)
    return reduce(lcp, ordered) or ordered[0]


def node_modules(graph) -> dict[str, str]:
    """The module of every op node.

    The traced module (``module`` attribute, set by :func:`gradscope.trace`) when there is one; otherwise
    the module of the parameters the node consumes, directly or through a parameter-only view such as
    ``TBackward0`` (``weight.t()``), or whose storage it saved; otherwise :data:`NO_MODULE`. When the
    parameters belong to several modules, their longest common dotted prefix is used.

    Returns:
        ``{node id: module name}`` for every op node.
    """
    by_storage = {}
    for name, p in graph.graph.get("params", {}).items():
        if p.get("storage") is not None and _owner_module(name):
            by_storage.setdefault(p["storage"], set()).add(_owner_module(name))
    nodes = dict(graph.nodes(data=True))
    pred = getattr(graph, "_pred", None) or graph.pred     # networkx's adjacency dict: no view objects
    from_params: dict[str, set] = {}        # leaf or parameter-only view (weight.t()) -> its modules
    for nid, d in nodes.items():
        kind = d.get("kind")
        if kind == "param":
            from_params[nid] = {d["module"]} if d.get("module") else set()
        elif kind == "op" and not d["saved"] and pred[nid]:
            preds = [nodes[w] for w in pred[nid]]
            if all(p.get("kind") == "param" for p in preds):
                from_params[nid] = {p["module"] for p in preds if p.get("module")}
    out: dict[str, str] = {}
    for nid, d in nodes.items():
        if d.get("kind") != "op":
            continue
        if d.get("module"):
            out[nid] = d["module"]
            continue
        mods: set[str] = set()
        if by_storage:
            for e in d["saved"]:
                mods.update(by_storage.get(e.get("storage"), ()))
        for u in pred[nid]:
            m = from_params.get(u)
            if m:
                mods.update(m)
        out[nid] = _common(mods) or NO_MODULE
    return out


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
