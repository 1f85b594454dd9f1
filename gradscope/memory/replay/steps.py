"""The pieces of :func:`~gradscope.memory.replay.simulate.simulate` that one node's step calls: a checkpoint
region's tensors re-created when its first node runs (NOTE [recompute step by step] in
:mod:`gradscope.memory.replay.recompute`), the bytes a formula makes after it returns, the workspace per node,
and the parameters a traced reentrant region shares with the graph.
"""

from __future__ import annotations

from gradscope.memory.replay.engine import Program, reentrant_nodes
from gradscope.memory.replay.gradients import Memory
from gradscope.memory.replay.recompute import recompute_high

__all__ = ["recompute_node", "create_region_tensors", "after_formula", "by_node", "shared_leaves"]


def recompute_node(
    prog: Program, mem: Memory, v: int, fresh: list, sizes: dict, drop, created: set, done: set, grad_scale=None
) -> None:
    """Node ``v`` of a checkpoint region runs: the region's tensors in ``fresh`` (``[(key, bytes)]``) not
    made yet are re-created, each held by the region's nodes that save it and have not run; the recompute's
    temporaries raise the node's highest point (NOTE [recompute step by step])."""
    rkeys = dict.fromkeys(key[1] for key, _ in fresh if key not in created and key not in drop)
    for rkey in rkeys:  # one region after the other: each one's highest point above what the others left
        top = recompute_high(prog, rkey, sizes, grad_scale)
        if top:
            mem.high = max(mem.high, mem.level + top)
        create_region_tensors(prog, mem, v, [kb for kb in fresh if kb[0][1] == rkey], sizes, drop, created, done)


def create_region_tensors(
    prog: Program, mem: Memory, v: int, fresh: list, sizes: dict, drop, created: set, done: set
) -> None:
    saved, st_refs = prog.saved, mem.st_refs
    for key, nbytes in fresh:
        if key not in created and key not in drop:
            created.add(key)
            nbytes = sizes.get(key, nbytes)
            holders = sum(1 for u in prog.regions.get(key[1], ()) if key in saved[u] and (u == v or u not in done))
            if not holders:  # re-created and dropped inside the recompute
                mem.high = max(mem.high, mem.level + nbytes)
                continue
            mem.hold_storage(key, nbytes, allocate=True)
            st_refs[key] = holders


def after_formula(prog: Program, v: int, es: list, grad_scale) -> int:
    """Bytes of ``v``'s outputs made after its formula returned, so after the kernel's copy of an expanded
    gradient is gone: ``addmm``'s ``self`` (bias) gradient is the incoming gradient itself, which the
    engine then sums to the bias's shape."""
    if prog.name[v] != "AddmmBackward0":
        return 0
    for (u, k), pos in zip(es, prog.needs[v]):
        if pos == 0:
            nbytes = prog.grad_bytes[u][k] if k < len(prog.grad_bytes[u]) else 0
            return grad_scale(u, k, nbytes) if grad_scale is not None else nbytes
    return 0


def by_node(workspace, leaf: list) -> dict:
    """``{node index: bytes}`` of a ``workspace(node index)`` callable, over the op nodes."""
    return {v: w for v, lf in enumerate(leaf) if not lf and (w := workspace(v))}


def shared_leaves(prog: Program) -> dict | None:
    """Leaf index -> name of the parameters that the graph and a traced reentrant region both use (their
    ``.grad`` is set by whichever backward reaches them first), or None (cached on the program)."""
    got = prog.__dict__.get("_shared_leaves", 0)
    if got != 0:
        return got
    from gradscope.memory.replay.traced import region_params

    names: set = set()
    for _, extra in reentrant_nodes(prog):
        names |= region_params(extra.get("region_recompute") or {})
    found = {i: n for i, (kind, n) in prog.leaves().items() if kind == "param" and n in names} if names else {}
    prog.__dict__["_shared_leaves"] = found or None
    return found or None
