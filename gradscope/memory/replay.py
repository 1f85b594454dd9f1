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

The simulation tracks tensors (``impl`` ids with a reference count) and storages (a count of live impls
plus graph holders), so views, pass-through gradients and shared saved storages free exactly when torch
frees them.
"""

from __future__ import annotations

from gradscope.memory.engine import Program, engine_order, numel_bytes

__all__ = ["simulate", "Trace", "VIEW_OPS", "PASS_OPS"]

#: Formulas whose gradient is a view of the incoming gradient (same storage).
VIEW_OPS = frozenset(
    {
        "ViewBackward0",
        "UnsafeViewBackward0",
        "TBackward0",
        "TransposeBackward0",
        "TransposeBackward1",
        "PermuteBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "SqueezeBackward3",
        "SqueezeBackward4",
        "UnsqueezeBackward0",
        "UnsqueezeBackward1",
        "ReshapeAliasBackward0",
        "AliasBackward0",
        "SumBackward0",
        "SumBackward1",
        "ExpandBackward0",
        "ViewAsRealBackward0",
        "ViewAsComplexBackward0",
        "NumpyTBackward0",
    }
)
#: Formulas that send the incoming gradient tensor itself (when the bytes and dtype match).
PASS_OPS = frozenset(
    {
        "AddBackward0",
        "AddBackward1",
        "CloneBackward0",
        "ToCopyBackward0",
        "SubBackward0",
        "SubBackward1",
        "LiftFreshBackward0",
        "DetachBackward0",
    }
)
#: Formulas whose gradients are pieces of the incoming gradient: ``cat`` narrows it, ``stack`` selects.
_PIECE_OPS = frozenset({"CatBackward0", "StackBackward0"})
#: Formulas whose gradient is the incoming gradient expanded (``sum``: ``grad.expand(self_sizes)``).
_EXPAND_OPS = frozenset({"SumBackward0", "SumBackward1"})
#: Outputs of PASS_OPS that are not passed on (``SubBackward0``'s ``other`` gets ``-grad``).
_PASS_ONLY_FIRST = frozenset({"SubBackward0"})


_EMPTY: dict = {}
#: name -> bit set: 1 view, 2 expand, 4 pieces, 8 pass (0: every output is a new tensor)
_KIND = {
    n: (n in VIEW_OPS) | (n in _EXPAND_OPS) << 1 | (n in _PIECE_OPS) << 2 | (n in PASS_OPS) << 3
    for n in VIEW_OPS | PASS_OPS | _PIECE_OPS | _EXPAND_OPS
}


class Trace:
    """What one replay produced (indices into the program; :mod:`backward` turns them into ids)."""

    __slots__ = (
        "order",
        "levels",
        "inner",
        "peak",
        "peak_at",
        "end",
        "allocated",
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
        self.allocated: list[int] = []  # bytes each node allocated (outputs, sums, workspace excluded)
        self.freed: list[int] = []
        self.grads_kept = 0  # bytes that ended in .grad (stolen or cloned)
        self.saved_freed = 0


class _Mem:
    """Tensors and storages alive in the simulated backward."""

    __slots__ = (
        "level",
        "high",
        "impl_refs",
        "impl_storage",
        "impl_view",
        "st_refs",
        "st_bytes",
        "next_id",
        "origin",
        "cur",
        "snap",
        "snap_at",
    )

    def __init__(self) -> None:
        self.level = 0
        self.high = 0
        self.impl_refs: dict = {}
        self.impl_storage: dict = {}
        self.impl_view: dict = {}
        self.st_refs: dict = {}
        self.st_bytes: dict = {}
        self.next_id = 0
        self.origin: dict = {}  # gradient storage -> the node that made it
        self.cur: int | None = None
        self.snap: dict | None = None  # live storages at the highest point of node ``snap_at``
        self.snap_at: int | None = None

    def alloc(self, nbytes: int) -> int:
        """A new dense tensor (one reference) on a new storage; returns its impl id."""
        i = self.next_id = self.next_id + 1
        st = ("g", i)
        self.st_refs[st] = 1
        self.st_bytes[st] = nbytes
        self.origin[st] = self.cur
        self.impl_refs[i] = 1
        self.impl_storage[i] = st
        self.impl_view[i] = False
        self.level += nbytes
        if self.level > self.high:
            self.high = self.level
            if self.cur is not None and self.cur == self.snap_at:
                self.snap = dict(self.st_bytes)
        return i

    def view(self, impl: int, kind: str = "view") -> int:
        i = self.next_id = self.next_id + 1
        st = self.impl_storage[impl]
        self.st_refs[st] += 1
        self.impl_refs[i] = 1
        self.impl_storage[i] = st
        self.impl_view[i] = kind
        return i

    def ref(self, impl: int) -> int:
        self.impl_refs[impl] += 1
        return impl

    def unref(self, impl: int) -> int:
        """Drop one reference; returns the bytes freed."""
        n = self.impl_refs[impl] - 1
        if n:
            self.impl_refs[impl] = n
            return 0
        del self.impl_refs[impl]
        self.impl_view.pop(impl, None)
        return self.drop_storage(self.impl_storage.pop(impl))

    def drop_storage(self, st) -> int:
        n = self.st_refs[st] - 1
        if n:
            self.st_refs[st] = n
            return 0
        del self.st_refs[st]
        freed = self.st_bytes.pop(st, 0)
        self.level -= freed
        return freed

    def hold_storage(self, st, nbytes: int, allocate: bool) -> None:
        """A graph storage (saved tensor) with one more holder; ``allocate`` when it is created now."""
        if st in self.st_refs:
            self.st_refs[st] += 1
            return
        self.st_refs[st] = 1
        self.st_bytes[st] = nbytes
        if allocate:
            self.level += nbytes
            if self.level > self.high:
                self.high = self.level

    def sole(self, impl: int) -> bool:
        return (
            self.impl_refs.get(impl) == 1
            and not self.impl_view.get(impl)
            and self.st_refs.get(self.impl_storage[impl]) == 1
        )


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
    """
    has_grad = prog.has_grad if has_grad is None else has_grad
    sizes = prog.storages if storage_bytes is None else storage_bytes
    recompute = prog.recompute if recompute is None else recompute
    mem = _Mem()
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
    order_append, levels_append, inner_append, allocated_append = (
        out.order.append,
        out.levels.append,
        out.inner.append,
        out.allocated.append,
    )
    snapping = snapshot_at is not None
    release = not retain_graph

    def run(v: int) -> None:
        before = mem.high = mem.level
        mem.cur = v
        if snapping and v == snapshot_at:
            mem.snap = dict(st_bytes)
        inputs = buffers.pop(v, _EMPTY)
        if recompute and v in recompute:
            _recompute(v)
        if leaf[v]:
            g = inputs.get(0)
            if g is not None:
                if has_grad.get(v):
                    unref(g)  # .grad += new_grad, in place
                elif impl_refs.get(g) == 1 and impl_view.get(g) != "expand":
                    out.grads_kept += st_bytes.get(impl_storage[g], 0)  # stolen: it becomes .grad
                else:
                    alloc(gbytes[v][0])
                    out.grads_kept += gbytes[v][0]
                    unref(g)
        else:
            extra_attrs = (
                (op_extra.get(v) or _EMPTY) if op_extra is not None else (prog.attrs[v].get("attrs") or _EMPTY)
            )
            es = edges[v]
            nested = _nested(v, extra_attrs) if extra_attrs else None
            if nested is not None:  # NOTE [reentrant checkpoint backward]
                mem.high = max(mem.high, mem.level + nested.forward_peak, mem.level + nested.peak)
                mem.level += nested.end - nested.input_grad  # the input's grad is the output made below
                out.grads_kept += nested.grads_kept
            outputs = _outputs(v, names[v], inputs, es, needs[v], gbytes, mem, grad_scale, extra_attrs.get("alpha", 1))
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
            for (u, k), g in zip(es, outputs):
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
        done.add(v)
        order_append(v)
        level = mem.level
        levels_append(level)
        high = mem.high
        inner_append(high if high > level else level)
        allocated_append(high - before if high > before else 0)

    def _nested(v: int, extra_attrs: dict):
        rec = extra_attrs.get("region_recompute")
        if not rec or not rec.get("layers"):
            return None
        from gradscope.memory.reentrant import node_effect

        return node_effect(prog, v, rec, simulate)

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

    engine_order(prog, run)
    out.snapshot = mem.snap
    out.origin = mem.origin
    for impl in seeds:
        mem.unref(impl)
    out.end = mem.level
    if out.inner:
        i = max(range(len(out.inner)), key=out.inner.__getitem__)
        out.peak, out.peak_at = max(out.inner[i], 0), out.order[i]
    return out


def _outputs(
    v: int, name: str, inputs: dict, edges: list, positions: list, gbytes: list, mem: _Mem, grad_scale, alpha=1
) -> list:
    """The gradient tensor (impl id) the formula of ``v`` sends along each edge."""
    g0 = inputs.get(0)
    kind = _KIND.get(name, 0)
    if g0 is None or not kind:  # nothing to pass on: a new tensor per edge
        if grad_scale is None:
            return [mem.alloc(gbytes[u][k] if k < len(gbytes[u]) else 0) for u, k in edges]
    in_bytes = mem.st_bytes.get(mem.impl_storage[g0], -1) if g0 is not None else -1
    view = kind & 1
    expand = kind & 2 and len(inputs) == 1
    pieces = kind & 4 and len(inputs) == 1
    passes = kind & 8
    outs = []
    for i, (u, k) in enumerate(edges):
        nbytes = gbytes[u][k] if k < len(gbytes[u]) else 0
        if grad_scale is not None:
            nbytes = grad_scale(u, k, nbytes)
        if g0 is not None and pieces:
            outs.append(mem.view(g0))
            continue
        if g0 is not None and expand:
            outs.append(mem.view(g0, "expand"))  # grad.expand(sizes): a stride-0 view of the incoming grad
            continue
        if g0 is not None and nbytes == in_bytes and len(inputs) == 1:
            if view:
                outs.append(mem.view(g0))
                continue
            pos = positions[i] if i < len(positions) else i
            if passes and not (pos > 0 and (name in _PASS_ONLY_FIRST or alpha != 1)):
                outs.append(mem.ref(g0))
                continue
        outs.append(mem.alloc(nbytes))
    return outs
