"""The backward replay: the engine's rules applied to the compiled graph, byte by byte.

NOTE [what one node does to memory] (TORCH-FACTS section 14)
At node ``v`` the engine (1) takes the gradients in ``v``'s InputBuffer, (2) runs the formula, which
allocates its outputs (some formulas return views of, or pass on, the incoming gradient: :data:`VIEW_OPS`,
:data:`PASS_OPS`) plus kernel workspace that it frees before returning, (3) drops the incoming gradients,
(4) releases ``v``'s saved tensors (unless ``retain_graph``), a storage being freed when its last holder
goes, (5) moves each output into its target's InputBuffer; a second gradient for the same input is
summed in place when one of the two is a plain tensor that solely owns its tensor and storage, else
``old + new`` allocates. AccumulateGrad steals a sole-owned incoming gradient when ``.grad`` is None,
clones it otherwise, and adds it in place when ``.grad`` is set. A non-reentrant checkpoint region
re-creates the tensors its nodes saved at its first unpack; each lives until the last node saving it ran.

The simulation tracks tensors and storages with ``gradients.Memory`` (views, pass-through gradients and
shared saved storages free exactly when torch frees them); ``gradients.outputs`` is step (2).
"""

from __future__ import annotations

from gradscope.memory.engine import Program, engine_steps, numel_bytes
from gradscope.memory.gradients import OUTPUT_KINDS, PASS_OPS, VIEW_OPS, Memory, outputs

__all__ = ["simulate", "Trace", "VIEW_OPS", "PASS_OPS"]

_EMPTY: dict = {}


class Trace:
    """What one replay produced (indices into the program; :mod:`backward` turns them into ids)."""

    __slots__ = (
        "order",
        "levels",
        "inner",
        "peak",
        "peak_at",
        "end",
        "freed",
        "grads_kept",
        "saved_freed",
        "snapshot",
        "origin",
    )

    snapshot: dict | None  # set by replay (None unless ``snapshot_at`` was given)
    origin: dict  # set by replay

    def __init__(self) -> None:
        self.order: list[int] = []
        self.levels: list[int] = []  # after each node
        self.inner: list[int] = []  # highest level inside each node (workspace included)
        self.peak = 0
        self.peak_at: int | None = None
        self.end = 0
        self.freed: list[int] = []
        self.grads_kept = 0  # bytes that ended in .grad (stolen or cloned)
        self.saved_freed = 0


def simulate(
    prog: Program,
    *,
    retain_graph: bool = False,
    has_grad: dict | None = None,
    storage_bytes: dict | None = None,
    grad_scale=None,
    workspace=None,
    drop: frozenset = frozenset(),
    recompute: dict | None = None,
    snapshot_at: int | None = None,
    held_seeds: bool = False,
) -> Trace:
    """Replay backward over ``prog`` (see NOTE [what one node does to memory]).

    Args:
        retain_graph: saved tensors are not released.
        has_grad: leaf index -> whether ``.grad`` is set (default: as inspected).
        storage_bytes: storage key -> bytes (default ``prog.storages``), e.g. scaled by the batch.
        grad_scale: optional ``f(node index, output nr, bytes) -> bytes`` for gradient sizes.
        workspace: optional ``f(node index) -> bytes`` allocated and freed inside the node.
        drop: storage keys that are not on the device during backward (offloaded): never counted.
        recompute: node index -> ``[(storage key, bytes)]`` re-created at the node's first run within its
            region (default ``prog.recompute``); keys shared by a region are created once.
        snapshot_at: a node index: ``trace.snapshot`` is then ``{storage key: bytes}`` of what is alive at
            that node's highest point, and ``trace.origin`` the node that made each gradient storage.
        held_seeds: the roots' gradients exist already and are held outside (a reentrant checkpoint's
            nested backward: the outer node's incoming gradients): not counted, never freed or stolen.
    """
    has_grad = prog.has_grad if has_grad is None else has_grad
    sizes = prog.storages if storage_bytes is None else storage_bytes
    recompute = prog.recompute if recompute is None else recompute
    mem = Memory()
    mem.snap_at = snapshot_at
    external = prog.external
    refs0, bytes0 = mem.st_refs, mem.st_bytes
    for keys in prog.saved:
        for key in keys:
            if key in drop or key[0] == "r":
                continue
            n = refs0.get(key)
            if n is None:  # a holder outside the graph (external) is one more: never freed by backward
                refs0[key] = 2 if key in external else 1
                bytes0[key] = sizes.get(key, 0)
            else:
                refs0[key] = n + 1
    buffers: dict = {}
    out = Trace()
    gbytes = prog.grad_bytes
    names = prog.name
    seeds = []
    for r, nbytes in zip(prog.roots, prog.root_bytes):
        impl = mem.alloc(nbytes)  # torch.autograd.backward's ones_like(root), held until it returns
        seeds.append(mem.ref(impl))
        buffers.setdefault(r, {})[0] = impl
        if held_seeds:
            mem.st_refs[mem.impl_storage[impl]] += 1
            mem.level -= nbytes
    created_regions: set = set()
    done: set = set()
    leaf = prog.leaf
    edges = prog.edges
    op_extra = prog.extra

    saved = prog.saved
    needs = prog.needs
    st_refs, st_bytes, impl_refs, impl_storage, impl_view = (
        mem.st_refs,
        mem.st_bytes,
        mem.impl_refs,
        mem.impl_storage,
        mem.impl_view,
    )
    alloc, unref, sole = mem.alloc, mem.unref, mem.sole
    order_append, levels_append, inner_append = out.order.append, out.levels.append, out.inner.append
    snapping = snapshot_at is not None
    release = not retain_graph
    kinds = OUTPUT_KINDS
    attrs = prog.attrs
    get_extra = op_extra.get if op_extra is not None else (lambda v: attrs[v].get("attrs"))
    track_done = bool(recompute)

    given: set = set()  # parameters whose .grad a traced reentrant region's nested backward set
    shared = _shared_leaves(prog)  # leaf index -> name, for the parameters such regions use too

    def _nested(v: int, extra_attrs: dict):
        from gradscope.memory.reentrant import modelled_region, node_effect

        rec = modelled_region(extra_attrs)
        return None if rec is None else node_effect(prog, v, rec, simulate, given)

    def _recompute(v: int) -> None:
        for key, nbytes in recompute[v]:
            if key not in created_regions and key not in drop:
                created_regions.add(key)
                nbytes = sizes.get(key, nbytes)
                holders = sum(1 for u in prog.regions.get(key[1], ()) if key in saved[u] and (u == v or u not in done))
                if not holders:  # re-created and dropped inside the recompute
                    mem.high = max(mem.high, mem.level + nbytes)
                    continue
                mem.hold_storage(key, nbytes, allocate=True)
                st_refs[key] = holders

    for v in engine_steps(prog):  # NOTE [what one node does to memory], one node per step
        mem.high = mem.level
        mem.cur = v
        if snapping and v == snapshot_at:
            mem.snap = dict(st_bytes)
        inputs = buffers.pop(v, _EMPTY)
        if recompute and v in recompute:
            _recompute(v)
        if leaf[v]:
            g = inputs.get(0)
            if g is not None:
                if shared is not None and v in shared:  # a parameter a traced reentrant region uses too
                    if shared[v] in given:
                        has_grad = {**has_grad, v: True}
                    given.add(shared[v])
                if has_grad.get(v):
                    unref(g)  # .grad += new_grad, in place
                elif impl_refs.get(g) == 1 and impl_view.get(g) != "expand":
                    out.grads_kept += st_bytes.get(impl_storage[g], 0)  # stolen: it becomes .grad
                else:
                    alloc(gbytes[v][0])
                    out.grads_kept += gbytes[v][0]
                    unref(g)
        else:
            extra_attrs = get_extra(v) or _EMPTY
            es = edges[v]
            nested = _nested(v, extra_attrs) if extra_attrs else None
            if nested is not None:  # NOTE [reentrant checkpoint backward]
                mem.high = max(mem.high, mem.level + nested.forward_peak, mem.level + nested.peak)
                mem.level += nested.end - nested.input_grad  # the input's grad is the output made below
                out.grads_kept += nested.grads_kept
            name = names[v]
            if grad_scale is None and (0 not in inputs or not kinds.get(name)):  # outputs()'s first case
                if len(es) == 1:  # most nodes: no comprehension to set up
                    u, k = es[0]
                    gb = gbytes[u]
                    sent = [alloc(gb[k] if k < len(gb) else 0)]
                else:
                    sent = [alloc(gbytes[u][k] if k < len(gbytes[u]) else 0) for u, k in es]
            else:
                sent = outputs(v, name, inputs, es, needs[v], gbytes, mem, grad_scale, extra_attrs.get("alpha", 1))
            if workspace is not None:
                extra = workspace(v)
                if extra:
                    if v == snapshot_at and mem.level + extra >= mem.high:
                        mem.snap = {**st_bytes, ("w", v): extra}
                    mem.high = max(mem.high, mem.level + extra)
            if extra_attrs and nested is None:
                for shape, dtype, had, *_ in extra_attrs.get("region_params") or ():
                    if not had:  # reentrant checkpoint: the nested backward fills the region's .grads
                        nbytes = numel_bytes(shape, dtype)
                        alloc(nbytes)
                        out.grads_kept += nbytes
            for g in inputs.values():
                n = impl_refs[g] - 1
                if n:
                    impl_refs[g] = n
                else:
                    unref(g)
            if release:
                for key in saved[v]:  # drop_storage, inlined: the hottest loop of the replay
                    n = st_refs.get(key)
                    if n is None or key in drop:
                        continue
                    if n > 1:
                        st_refs[key] = n - 1
                    else:
                        del st_refs[key]
                        freed = st_bytes.pop(key, 0)
                        mem.level -= freed
                        out.saved_freed += freed
            for (u, k), g in zip(es, sent):
                if g is None:
                    continue
                slot = buffers.get(u)
                if slot is None:
                    buffers[u] = {k: g}
                    continue
                old = slot.get(k)
                if old is None:
                    slot[k] = g
                elif sole(old):
                    unref(g)
                elif sole(g):
                    unref(old)
                    slot[k] = g
                else:
                    new = alloc(max(st_bytes.get(impl_storage[old], 0), gbytes[u][k]))
                    unref(old)
                    unref(g)
                    slot[k] = new
        if track_done:
            done.add(v)
        order_append(v)
        level = mem.level
        levels_append(level)
        high = mem.high
        inner_append(high if high > level else level)
    out.snapshot = mem.snap
    out.origin = mem.origin
    for impl in seeds:
        mem.unref(impl)
    out.end = mem.level
    if out.inner:
        top = max(out.inner)
        out.peak, out.peak_at = max(top, 0), out.order[out.inner.index(top)]  # the first node at the top
    return out


def _shared_leaves(prog: Program) -> dict | None:
    """Leaf index -> name of the parameters that the graph and a traced reentrant region both use (their
    ``.grad`` is set by whichever backward reaches them first), or None (cached on the program)."""
    got = prog.__dict__.get("_shared_leaves", 0)
    if got != 0:
        return got
    from gradscope.memory.traced import region_params

    names: set = set()
    if "CheckpointFunctionBackward" in prog.name:
        for v, name in enumerate(prog.name):
            if name == "CheckpointFunctionBackward":
                extra = (prog.extra.get(v) if prog.extra is not None else prog.attrs[v].get("attrs")) or {}
                names |= region_params(extra.get("region_recompute") or {})
    found = {i: n for i, (kind, n) in prog.leaves().items() if kind == "param" and n in names} if names else {}
    prog.__dict__["_shared_leaves"] = found or None
    return found or None
