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

from gradscope.memory.replay.engine import Program, engine_order
from gradscope.memory.replay.gradients import PASS_OPS, VIEW_OPS, Memory, outputs
from gradscope.memory.replay.steps import (
    Run,
    expanded_copy,
    hold_saved,
    leaf_step,
    recompute_node,
    region_grads,
    run_steps,
    seed_gradients,
)

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
    subprograms: dict | None = None,
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
        subprograms: node index -> ``[steps.Step]``, run in place of its workspace (NOTE [node sub-programs]).
    """
    sizes = prog.storages if storage_bytes is None else storage_bytes
    mem = Memory()
    mem.snap_at = snapshot_at
    hold_saved(prog, mem, sizes, drop)
    run = Run(
        prog,
        mem,
        sizes=sizes,
        drop=drop,
        recompute=prog.recompute if recompute is None else recompute,
        grad_scale=grad_scale,
        has_grad=prog.has_grad if has_grad is None else has_grad,
        snapshot_at=snapshot_at,
        workspace=workspace,
        subprograms=subprograms,
    )
    run.release = not retain_graph
    seeds = seed_gradients(prog, mem, run.buffers, held_seeds)
    out = Trace()
    out.order = engine_order(prog)
    _run_nodes(run, out)
    out.grads_kept, out.saved_freed = run.grads_kept, run.saved_freed
    out.snapshot = mem.snap
    out.origin = mem.origin if run.origin is not None else {}
    for impl in seeds:
        mem.unref(impl)
    out.end = mem.level
    if out.inner:
        top = max(out.inner)
        out.peak, out.peak_at = max(top, 0), out.order[out.inner.index(top)]  # the first node at the top
    return out


def _run_nodes(run: Run, out: Trace) -> None:
    """Every node in the engine's order, one step each; ``out.levels`` and ``out.inner`` get the level after
    each node and the highest level inside it."""
    mem, buffers, leaf, recompute, snapshot_at = run.mem, run.buffers, run.prog.leaf, run.recompute, run.snapshot_at
    st_bytes = mem.st_bytes
    levels_append, inner_append = out.levels.append, out.inner.append
    track_done, done = run.track_done, run.done
    level = high = mem.level  # kept in locals; written to ``mem`` around every call that reads or changes it
    for v in out.order:  # NOTE [what one node does to memory], one node per step
        high = level
        if v == snapshot_at:
            mem.snap = dict(st_bytes)
        inputs = buffers[v] or _EMPTY  # a node runs once: its buffer is not read again
        if recompute and v in recompute:
            mem.level, mem.high, mem.cur = level, high, v
            recompute_node(run.prog, mem, v, recompute[v], run.sizes, run.drop, run.created, done, run.grad_scale)
            level, high = mem.level, mem.high
        if leaf[v]:
            level, high = leaf_step(run, v, inputs.get(0), level, high)
        else:
            level, high = _op_step(run, v, inputs, level, high)
        if track_done:
            done.add(v)
        levels_append(level)
        inner_append(high)  # never below the level: every step that raises the level raises it too
    mem.level, mem.high = level, high


def _op_step(run: Run, v: int, inputs: dict, level: int, high: int) -> tuple[int, int]:
    """Op node ``v``'s step (NOTE [what one node does to memory], steps 2 to 5)."""
    mem, prog = run.mem, run.prog
    extra_attrs = run.ext[v]
    es = prog.edges[v]
    nested = None
    released = None
    if run.subs is not None and v in run.subs:  # NOTE [node sub-programs]
        level, high, released = run_steps(run, v, run.subs[v], inputs, level, high)
    elif extra_attrs is not None and "region_recompute" in extra_attrs:
        nested = _nested(prog, v, extra_attrs, run.given)
        if nested is not None:  # NOTE [reentrant checkpoint backward]
            level, high = _nested_step(run, v, nested, level, high)
    if run.grad_scale is None and (not run.kind[v] or 0 not in inputs):  # outputs()'s first case
        level, high, pending = _new_gradients(run, v, es, level, high)
    else:
        mem.level, mem.high, mem.cur = level, high, v
        alpha = extra_attrs.get("alpha", 1) if extra_attrs is not None else 1
        sent = outputs(
            v, prog.name[v], inputs, es, prog.needs[v], prog.grad_bytes, mem, run.grad_scale, alpha, run.as_view.get(v)
        )
        level, high = mem.level, mem.high
        pending = [(u, k, g) for (u, k), g in zip(es, sent) if g is not None]
    wsd = run.wsd
    extra = wsd.get(v, 0) if wsd is not None and released is None else 0
    if mem.impl_view and not run.kind[v]:
        extra += expanded_copy(run, v, es, inputs.get(0))
    if extra:
        if v == run.snapshot_at and level + extra >= high:
            mem.snap = {**mem.st_bytes, ("w", v): extra}
        if level + extra > high:
            high = level + extra
    if extra_attrs is not None and nested is None and extra_attrs.get("region_params"):
        level, high = region_grads(run, v, extra_attrs["region_params"], level, high)
    level = _drop_inputs(mem, inputs, level)
    if run.release:
        keys = prog.saved[v] if not released else [k for k in prog.saved[v] if k not in released]
        level = _release_saved(run, keys, level)
    elif run.track_done:  # retain_graph: a recomputed tensor still dies at its last unpack (NOTE above)
        for key in prog.saved[v]:
            if key[0] == "r" and key in mem.st_refs:
                mem.level = level
                mem.drop_storage(key)
                level = mem.level
    if pending:
        level, high = _into_buffers(run, v, pending, level, high)
    return level, high


def _nested_step(run: Run, v: int, nested, level: int, high: int) -> tuple[int, int]:
    """A modelled reentrant checkpoint node: its recompute and nested backward raise the highest point; what
    the nested backward leaves (its parameters' ``.grad``) stays."""
    mem = run.mem
    top = max(nested.forward_peak, nested.peak)
    if v == run.snapshot_at and level + top >= high:  # the peak is inside the nested backward
        mem.snap = {**mem.st_bytes, ("n", v): top}
    high = max(high, level + top)
    level += nested.end - nested.input_grad  # the input's grad is the output made below
    if run.origin is not None:  # a snapshot: what the nested backward left (its parameters' .grad)
        mem.st_bytes[("k", v)] = nested.end - nested.input_grad
    run.grads_kept += nested.grads_kept
    return level, high


def _new_gradients(run: Run, v: int, es: list, level: int, high: int) -> tuple[int, int, list | None]:
    """A new gradient tensor per edge of ``v`` (``Memory.alloc``, inlined); a first gradient for an input moves
    into its InputBuffer now, a second one is returned as pending ``(target, output, tensor)``, to be summed
    after the frees."""
    mem, buffers, gbytes = run.mem, run.buffers, run.prog.grad_bytes
    st_refs, st_bytes, impl_refs, impl_storage = mem.st_refs, mem.st_bytes, mem.impl_refs, mem.impl_storage
    new_id, origin, snapshot_at = mem.ids.__next__, run.origin, run.snapshot_at
    pending = None
    for u, k in es:
        try:
            nbytes = gbytes[u][k]
        except IndexError:  # an output the graph has no shape for
            nbytes = 0
        g = new_id()
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
    return level, high, pending


def _drop_inputs(mem: Memory, inputs: dict, level: int) -> int:
    """The node's incoming gradients are dropped (``Memory.unref``, inlined)."""
    impl_refs, impl_view, impl_storage, st_refs, st_bytes = (
        mem.impl_refs,
        mem.impl_view,
        mem.impl_storage,
        mem.st_refs,
        mem.st_bytes,
    )
    for g in inputs.values():
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
    return level


def _release_saved(run: Run, keys, level: int) -> int:
    """The node's saved tensors are released (``Memory.drop_storage``, inlined; offloaded keys were never
    counted)."""
    st_refs, st_bytes = run.mem.st_refs, run.mem.st_bytes
    for key in keys:
        n = st_refs.get(key)
        if n is None:
            continue
        if n > 1:
            st_refs[key] = n - 1
        else:
            del st_refs[key]
            freed = st_bytes.pop(key, 0)
            level -= freed
            run.saved_freed += freed
    return level


def _into_buffers(run: Run, v: int, pending: list, level: int, high: int) -> tuple[int, int]:
    """Gradients into the InputBuffers, each summed with a gradient already there: in place when that one is
    sole-owned, else ``old + new`` allocates."""
    mem, buffers, gbytes, grad_scale = run.mem, run.buffers, run.prog.grad_bytes, run.grad_scale
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
        if mem.sole(old):
            mem.unref(g)
        else:
            # ``old + new`` has the gradient's size, whatever storage the two view (a piece of
            # cat's gradient, sum()'s one-element expand)
            gb = gbytes[u][k] if grad_scale is None else grad_scale(u, k, gbytes[u][k])
            new = mem.alloc(gb or mem.st_bytes.get(mem.impl_storage[old], 0))
            mem.unref(old)
            mem.unref(g)
            slot[k] = new
    if synced:
        return mem.level, mem.high
    return level, high


def _nested(prog: Program, v: int, extra_attrs: dict, given: set):
    """The modelled recompute and nested backward of reentrant checkpoint node ``v``, or None (``given``:
    see :func:`~gradscope.memory.reentrant.node_effect`)."""
    from gradscope.memory.replay.reentrant import modelled_region, node_effect

    rec = modelled_region(extra_attrs)
    return None if rec is None else node_effect(prog, v, rec, simulate, given)
