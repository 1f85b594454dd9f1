"""The backward replay: the engine's rules applied to the compiled graph, byte by byte.

NOTE [what one node does to memory] (docs/internals.md#what-one-node-does-to-memory)
At node ``v`` the engine (1) takes the gradients in ``v``'s InputBuffer, (2) runs the formula, which
allocates its outputs (some formulas return views of, or pass on, the incoming gradient: :data:`VIEW_OPS`,
:data:`PASS_OPS`) plus kernel workspace that it frees before returning (a formula that does not read a
stride-0 gradient in place, :data:`READS_EXPANDED`, first copies ``sum()``'s expanded gradient to a dense
one), (3) drops the incoming gradients, (4) releases ``v``'s saved tensors (unless ``retain_graph``), a
storage being freed when its last holder goes, (5) moves each output into its target's InputBuffer; a second
gradient for the same input is summed in place when one of the two is a plain tensor that solely owns its
tensor and storage, else ``old + new`` allocates. AccumulateGrad steals a sole-owned incoming gradient when
``.grad`` is None, clones it otherwise, and adds it in place when ``.grad`` is set. A non-reentrant
checkpoint region re-creates the tensors its nodes saved at its first unpack; each lives until the last node
saving it ran, with ``retain_graph=True`` too (checkpoint hands a recomputed tensor over at its unpack and
keeps none).

The simulation tracks tensors and storages with ``gradients.Memory`` (views, pass-through gradients and
shared saved storages free exactly when torch frees them); ``gradients.outputs`` is step (2).
"""

from __future__ import annotations

from itertools import repeat

from gradscope.memory.kernels.layout import layout_clones, reshape_views
from gradscope.memory.replay.engine import Program, engine_order, node_extras, numel_bytes
from gradscope.memory.replay.gradients import (
    EXPANDED,
    OUTPUT_KINDS,
    PASS_OPS,
    READS_EXPANDED,
    VIEW_OPS,
    Memory,
    outputs,
)
from gradscope.memory.replay.steps import after_formula, by_node, recompute_node, shared_leaves

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
        workspace: optional ``{node index: bytes}`` (or ``f(node index) -> bytes``) allocated and freed inside
            the node.
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
    refs0, bytes0 = mem.st_refs, mem.st_bytes
    external = prog.external
    for keys in prog.saved:  # a holder outside the graph (external) is one more: never freed by backward
        for key in keys:
            if key in drop or key[0] == "r":
                continue
            n = refs0.get(key)
            if n is None:
                refs0[key] = 2 if key in external else 1
                bytes0[key] = sizes.get(key, 0)
            else:
                refs0[key] = n + 1
    buffers: list = [None] * len(prog.edges)  # per node, its InputBuffer {input nr: tensor} (None: empty)
    out = Trace()
    gbytes = prog.grad_bytes
    seeds = []
    for r, nbytes in zip(prog.roots, prog.root_bytes):
        impl = mem.alloc(nbytes)  # torch.autograd.backward's ones_like(root), held until it returns
        seeds.append(mem.ref(impl))
        if buffers[r] is None:
            buffers[r] = {}
        buffers[r][0] = impl
        if held_seeds:
            mem.st_refs[mem.impl_storage[impl]] += 1
            mem.level -= nbytes
    created_regions: set = set()
    done: set = set()
    leaf, edges, saved, needs, names = prog.leaf, prog.edges, prog.saved, prog.needs, prog.name
    st_refs, st_bytes, impl_refs, impl_storage, impl_view = (
        mem.st_refs,
        mem.st_bytes,
        mem.impl_refs,
        mem.impl_storage,
        mem.impl_view,
    )
    alloc, unref, sole, new_id = mem.alloc, mem.unref, mem.sole, mem.ids.__next__
    origin = mem.origin if snapshot_at is not None else None  # only a snapshot reads who made a gradient
    levels_append, inner_append = out.levels.append, out.inner.append
    release = not retain_graph
    kind = list(map(OUTPUT_KINDS.get, names, repeat(0)))  # 0: every output a new tensor
    unscaled = grad_scale is None
    ext = node_extras(prog)
    wsd = workspace if workspace is None or type(workspace) is dict else by_node(workspace, leaf)
    track_done = bool(recompute)
    as_view = reshape_views(prog)  # NOTE [gradient layout]: the reshapes that copy, or view a piece
    clones = layout_clones(prog)  # gradients AccumulateGrad clones to the parameter's layout

    given: set = set()  # parameters whose .grad a traced reentrant region's nested backward set
    shared = shared_leaves(prog)  # leaf index -> name, for the parameters such regions use too
    order = out.order = engine_order(prog)
    level = high = mem.level  # kept in locals; written to ``mem`` around every call that reads or changes it
    grads_kept = saved_freed = 0
    for v in order:  # NOTE [what one node does to memory], one node per step
        high = level
        if v == snapshot_at:
            mem.snap = dict(st_bytes)
        inputs = buffers[v] or _EMPTY  # a node runs once: its buffer is not read again
        if recompute and v in recompute:
            mem.level, mem.high, mem.cur = level, high, v
            recompute_node(prog, mem, v, recompute[v], sizes, drop, created_regions, done, grad_scale)
            level, high = mem.level, mem.high
        if leaf[v]:
            g = inputs.get(0)
            if g is not None and shared is not None and v in shared:  # a parameter a traced region uses too
                if shared[v] in given:
                    has_grad = {**has_grad, v: True}
                given.add(shared[v])
            if g is None:
                pass
            elif not has_grad.get(v) and impl_refs.get(g) == 1 and impl_view.get(g) not in EXPANDED and v not in clones:
                grads_kept += st_bytes.get(impl_storage[g], 0)  # stolen: it becomes .grad
            else:
                mem.level, mem.high, mem.cur = level, high, v
                if not has_grad.get(v):  # cloned; else .grad += new_grad, in place
                    alloc(gbytes[v][0])
                    grads_kept += gbytes[v][0]
                unref(g)
                level, high = mem.level, mem.high
            levels_append(level)
            inner_append(high)  # never below the level: every step that raises the level raises it too
            if track_done:
                done.add(v)
            continue
        extra_attrs = ext[v]
        es = edges[v]
        nested = None
        if extra_attrs is not None and "region_recompute" in extra_attrs:
            nested = _nested(prog, v, extra_attrs, given)
            if nested is not None:  # NOTE [reentrant checkpoint backward]
                top = max(nested.forward_peak, nested.peak)
                if v == snapshot_at and level + top >= high:  # the peak is inside the nested backward
                    mem.snap = {**st_bytes, ("n", v): top}
                high = max(high, level + top)
                level += nested.end - nested.input_grad  # the input's grad is the output made below
                if origin is not None:  # a snapshot: what the nested backward left (its parameters' .grad)
                    st_bytes[("k", v)] = nested.end - nested.input_grad
                grads_kept += nested.grads_kept
        pending = None  # (target, output, tensor) put in the InputBuffers after the frees
        if unscaled and (not kind[v] or 0 not in inputs):  # outputs()'s first case: a new tensor per edge
            for u, k in es:
                try:
                    nbytes = gbytes[u][k]
                except IndexError:  # an output the graph has no shape for
                    nbytes = 0
                g = new_id()  # Memory.alloc, inlined
                st_refs[g] = 1  # the storage of a new tensor is keyed by the tensor's id
                st_bytes[g] = nbytes
                impl_refs[g] = 1
                impl_storage[g] = g
                level += nbytes
                if level > high:
                    high = level
                    if v == snapshot_at:
                        mem.snap = dict(st_bytes)
                if origin is not None:
                    origin[g] = v
                slot = buffers[u]  # a first gradient for (u, k) moves in now: nothing else changes
                if slot is None:
                    buffers[u] = {k: g}
                elif k not in slot:
                    slot[k] = g
                elif pending is None:
                    pending = [(u, k, g)]
                else:
                    pending.append((u, k, g))
        else:
            mem.level, mem.high, mem.cur = level, high, v
            alpha = extra_attrs.get("alpha", 1) if extra_attrs is not None else 1
            sent = outputs(v, names[v], inputs, es, needs[v], gbytes, mem, grad_scale, alpha, as_view.get(v))
            level, high = mem.level, mem.high
            pending = [(u, k, g) for (u, k), g in zip(es, sent) if g is not None]
        extra = wsd.get(v, 0) if wsd is not None else 0
        if impl_view and not kind[v] and names[v] not in READS_EXPANDED:
            g = inputs.get(0)
            # NOTE above: a dense copy of it; a custom Function's backward is measured on the expanded
            # gradient itself (memory/kernels/signature.py), so its copy, if any, is in the measurement
            if g is not None and gbytes[v] and impl_view.get(g) in EXPANDED and not prog.attrs[v].get("function"):
                extra += gbytes[v][0] if unscaled else grad_scale(v, 0, gbytes[v][0])
                extra -= after_formula(prog, v, es, grad_scale)
        if extra:
            if v == snapshot_at and level + extra >= high:
                mem.snap = {**st_bytes, ("w", v): extra}
            if level + extra > high:
                high = level + extra
        if extra_attrs is not None and nested is None and extra_attrs.get("region_params"):
            mem.level, mem.high, mem.cur = level, high, v
            for shape, dtype, had, *_ in extra_attrs["region_params"]:
                if not had:  # reentrant checkpoint: the nested backward fills the region's .grads
                    nbytes = numel_bytes(shape, dtype)
                    alloc(nbytes)
                    grads_kept += nbytes
            level, high = mem.level, mem.high
        for g in inputs.values():  # Memory.unref, inlined
            n = impl_refs[g] - 1
            if n:
                impl_refs[g] = n
                continue
            del impl_refs[g]
            if impl_view:
                impl_view.pop(g, None)
            st = impl_storage.pop(g)
            n = st_refs[st] - 1
            if n:
                st_refs[st] = n
            else:
                del st_refs[st]
                level -= st_bytes.pop(st, 0)
        if release:
            for key in saved[v]:  # Memory.drop_storage, inlined (offloaded keys were never counted)
                n = st_refs.get(key)
                if n is None:
                    continue
                if n > 1:
                    st_refs[key] = n - 1
                else:
                    del st_refs[key]
                    freed = st_bytes.pop(key, 0)
                    level -= freed
                    saved_freed += freed
        elif track_done:  # retain_graph: a recomputed tensor still dies at its last unpack (NOTE above)
            for key in saved[v]:
                if key[0] == "r" and key in st_refs:
                    mem.level = level
                    mem.drop_storage(key)
                    level = mem.level
        if pending:  # into the InputBuffers, summed with a gradient already there
            synced = False
            for u, k, g in pending:
                slot = buffers[u]
                if slot is None:
                    buffers[u] = {k: g}
                    continue
                old = slot.get(k)
                if old is None:
                    slot[k] = g
                    continue
                if not synced:
                    mem.level, mem.high, mem.cur = level, high, v
                    synced = True
                if sole(old):
                    unref(g)
                else:
                    # ``old + new`` has the gradient's size, whatever storage the two view (a piece of
                    # cat's gradient, sum()'s one-element expand)
                    gb = gbytes[u][k] if unscaled else grad_scale(u, k, gbytes[u][k])
                    new = alloc(gb or st_bytes.get(impl_storage[old], 0))
                    unref(old)
                    unref(g)
                    slot[k] = new
            if synced:
                level, high = mem.level, mem.high
        if track_done:
            done.add(v)
        levels_append(level)
        inner_append(high)
    mem.level, mem.high = level, high
    out.grads_kept, out.saved_freed = grads_kept, saved_freed
    out.snapshot = mem.snap
    out.origin = mem.origin if origin is not None else {}
    for impl in seeds:
        mem.unref(impl)
    out.end = mem.level
    if out.inner:
        top = max(out.inner)
        out.peak, out.peak_at = max(top, 0), out.order[out.inner.index(top)]  # the first node at the top
    return out


def _nested(prog: Program, v: int, extra_attrs: dict, given: set):
    """The modelled recompute and nested backward of reentrant checkpoint node ``v``, or None (``given``:
    see :func:`~gradscope.memory.reentrant.node_effect`)."""
    from gradscope.memory.replay.reentrant import modelled_region, node_effect

    rec = modelled_region(extra_attrs)
    return None if rec is None else node_effect(prog, v, rec, simulate, given)
