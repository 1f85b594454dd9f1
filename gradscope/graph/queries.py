"""The questions every reader asks of ``report.graph``, answered once: held bytes, forward order, storages.

Everything here reads only the metadata graph, so it works the same on a report loaded back from JSON.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import networkx as nx

from gradscope.graph.schema import HELD, OFFLOADED, OP, PARAMS

__all__ = ["held_bytes", "forward_order", "param_storages", "StorageUse", "storage_uses"]


# -- held bytes ------------------------------------------------------------------------------------
def held_bytes(graph: nx.DiGraph, nodes: Iterable[str] | None = None) -> int:
    """Bytes held by saved tensors in ``graph`` (or only in ``nodes``), each storage counted once.

    Wrapped Python scalars are left out, as are slots that hold nothing on the device (recomputed,
    offloaded, freed). Entries without a storage id (sparse tensors) are counted one by one.

    Example:
        >>> import torch, gradscope
        >>> x = torch.randn(4, 4, requires_grad=True)
        >>> report = gradscope.inspect((x * x).sum())        # mul saves x twice: one storage
        >>> held_bytes(report.graph) == report.saved_bytes == 64
        True
    """
    seen: set = set()
    total = 0
    attrs = graph.nodes
    for data in attrs.values() if nodes is None else (attrs[n] for n in nodes):
        for e in data["saved"]:
            if e["status"] not in HELD or e.get("scalar"):
                continue
            sid = e["storage"]
            if sid is not None:
                if sid in seen:
                    continue
                seen.add(sid)
            total += e["nbytes"]
    return total


# -- forward order ---------------------------------------------------------------------------------
def forward_order(graph: nx.DiGraph) -> list[str]:
    """Op node ids in forward creation order (``seq``).

    Ties keep node order; ops without a sequence number (a hand-built or old graph) come last, after
    every op whose creation time is known, so they never take a storage's ownership or split a
    contiguous ``seq`` interval.
    """
    big = float("inf")
    ops = [(n, d.get("seq")) for n, d in graph.nodes(data=True) if d.get("kind") == OP]
    ops.sort(key=lambda ns: big if ns[1] is None else ns[1])  # stable: ties stay in node order
    return [n for n, _ in ops]


def param_storages(graph: nx.DiGraph) -> dict[int, set[str]]:
    """Storage id -> modules of the named parameters living in it."""
    out: dict[int, set[str]] = {}
    for name, p in graph.graph.get(PARAMS, {}).items():
        if p.get("storage") is not None:
            mods = out.setdefault(p["storage"], set())
            head = name.rpartition(".")[0]
            if head:
                mods.add(head)
    return out


# -- storages --------------------------------------------------------------------------------------
@dataclass(slots=True)
class StorageUse:
    """One saved storage, counted once (see NOTE [one storage, one owner] in gradscope/graph/attribution.py)."""

    key: tuple
    nbytes: int
    category: str  # "held" | "params" | "offloaded"
    owner: str  # node id of the first node that saved it
    device: str | None  # the device it was saved from (for offloaded: the device it left)
    users: list[str] = field(default_factory=list)  # node ids that saved it, forward order


def storage_uses(graph: nx.DiGraph, order: list[str] | None = None) -> list[StorageUse]:
    """Every saved storage once, in the order its owner was created.

    Args:
        graph: ``report.graph``.
        order: :func:`forward_order` of the graph, when the caller already has it.
    """
    params = param_storages(graph)
    uses: dict[tuple, StorageUse] = {}
    nodes = graph.nodes
    for nid in forward_order(graph) if order is None else order:
        for i, e in enumerate(nodes[nid]["saved"]):
            status = e["status"]
            if e.get("scalar") or (status not in HELD and status != OFFLOADED):
                continue
            sid = e["storage"]
            if status == OFFLOADED:
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
