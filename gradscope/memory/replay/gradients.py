"""The tensors of a simulated backward, and the gradients one formula sends (see ``simulate.py`` NOTE [what
one node does to memory]): :class:`Memory` tracks tensors (``impl`` ids with a reference count) and
storages (a count of live impls plus graph holders), so views, pass-through gradients and shared saved
storages free exactly when torch frees them; :func:`outputs` gives, per edge of a node, a new tensor, a
view of the incoming gradient or the incoming gradient itself."""

from __future__ import annotations

import itertools

__all__ = ["Memory", "outputs", "VIEW_OPS", "STRIDE_VIEWS", "PASS_OPS", "OUTPUT_KINDS", "EXPANDED", "READS_EXPANDED"]

#: View formulas that stay views whatever the incoming gradient's strides (a stride-0 expand included).
STRIDE_VIEWS = frozenset(
    {
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
        "AliasBackward0",
        "NumpyTBackward0",
    }
)
#: Formulas whose gradient is a view of the incoming gradient (same storage).
VIEW_OPS = STRIDE_VIEWS | {
    "ViewBackward0",
    "UnsafeViewBackward0",
    "ReshapeAliasBackward0",
    "SumBackward0",
    "SumBackward1",
    "ExpandBackward0",
    "ViewAsRealBackward0",
    "ViewAsComplexBackward0",
}
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
#: ``grad.reshape(sizes)``: a view of an all-stride-0 gradient, a copy of a partly expanded one.
_RESHAPES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})
#: Formulas that read a stride-0 (expanded) incoming gradient in place; any other formula that computes
#: with it (``mm``, ``layer_norm``, ``softmax``, ``gelu``, convolution, embedding, attention...) first
#: copies it to a dense tensor of its full size, freed when the node returns (measured on CPU: the list
#: is what reads it in place; unknown formulas count the copy, so the peak errs high, never low).
READS_EXPANDED = frozenset(
    {
        "MulBackward0",
        "MulBackward1",
        "DivBackward0",
        "DivBackward1",
        "NegBackward0",
        "TanhBackward0",
        "SigmoidBackward0",
        "ReluBackward0",
        "ThresholdBackward0",
        "SiluBackward0",
        "ExpBackward0",
        "PowBackward0",
        "PowBackward1",
        "SqrtBackward0",
        "AbsBackward0",
        "SinBackward0",
        "CosBackward0",
        "ClampBackward1",
        "ClampMinBackward0",
        "ClampMaxBackward0",
        "WhereBackward0",
        "MseLossBackward0",
        "NativeDropoutBackward0",
        "NllLossBackward0",
        "IndexBackward0",
        "GatherBackward0",
        "MeanBackward1",
        "MaxBackward0",
        "NormBackward1",
        "NativeBatchNormBackward0",
    }
)
#: The tags of an expanded gradient in ``Memory.impl_view``: ``expand0`` every stride 0 (``sum()``'s
#: gradient, ``grad.expand(sizes)`` of a scalar), ``expand`` some strides 0 (``sum(dim)``'s).
EXPANDED = frozenset({"expand", "expand0"})


#: name -> bit set: 1 view, 2 expand, 4 pieces, 8 pass (0: every output is a new tensor)
_KIND = {
    n: (n in VIEW_OPS) | (n in _EXPAND_OPS) << 1 | (n in _PIECE_OPS) << 2 | (n in PASS_OPS) << 3
    for n in VIEW_OPS | PASS_OPS | _PIECE_OPS | _EXPAND_OPS
}
#: The same, public: ``replay.simulate`` skips :func:`outputs` for kind 0 (every output a new tensor).
OUTPUT_KINDS = _KIND


class Memory:
    """Tensors and storages alive in the simulated backward."""

    __slots__ = (
        "level",
        "high",
        "impl_refs",
        "impl_storage",
        "impl_view",
        "st_refs",
        "st_bytes",
        "ids",
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
        self.ids = itertools.count(1)  # impl ids; a new tensor's storage is keyed by its impl id (an int)
        self.origin: dict = {}  # gradient storage -> the node that made it
        self.cur: int | None = None
        self.snap: dict | None = None  # live storages at the highest point of node ``snap_at``
        self.snap_at: int | None = None

    def alloc(self, nbytes: int) -> int:
        """A new dense tensor (one reference) on a new storage; returns its impl id."""
        i = next(self.ids)
        st = i
        self.st_refs[st] = 1
        self.st_bytes[st] = nbytes
        self.origin[st] = self.cur
        self.impl_refs[i] = 1
        self.impl_storage[i] = st  # not a view: no ``impl_view`` entry (read with .get)
        level = self.level = self.level + nbytes
        if level > self.high:
            self.high = level
            if self.cur is not None and self.cur == self.snap_at:
                self.snap = dict(self.st_bytes)
        return i

    def view(self, impl: int, kind: str = "view") -> int:
        i = next(self.ids)
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


def outputs(
    v: int,
    name: str,
    inputs: dict,
    edges: list,
    positions: list,
    gbytes: list,
    mem: Memory,
    grad_scale,
    alpha=1,
    as_view: bool | None = None,
) -> list:
    """The gradient tensor (impl id) the formula of ``v`` sends along each edge. ``as_view``: whether a
    view formula's gradient is a view, where the layout says (NOTE [gradient layout] in
    ``memory/kernels/layout.py``: a transpose always, a reshape when its strides allow); None: when it has
    the incoming gradient's bytes."""
    g0 = inputs.get(0)
    if as_view is None and name in STRIDE_VIEWS:
        as_view = True
    kind = _KIND.get(name, 0)
    if g0 is not None and kind and len(inputs) == 1 and mem.impl_view.get(g0) in EXPANDED:
        return _from_expanded(mem, g0, kind, name, edges, positions, gbytes, grad_scale, alpha)
    if g0 is None or not kind:  # nothing to pass on: a new tensor per edge
        if grad_scale is None:
            return [mem.alloc(gbytes[u][k] if k < len(gbytes[u]) else 0) for u, k in edges]
    elif grad_scale is None and len(inputs) == 1:  # the loop below for its common case, in fewer steps
        return _from_one(mem, g0, kind, name, edges, positions, gbytes, alpha, as_view)
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
            # grad.expand(sizes): a stride-0 view of the incoming grad
            outs.append(mem.view(g0, "expand0" if name == "SumBackward0" else "expand"))
            continue
        if g0 is not None and view and len(inputs) == 1 and (nbytes == in_bytes if as_view is None else as_view):
            outs.append(mem.view(g0))
            continue
        if g0 is not None and nbytes == in_bytes and len(inputs) == 1 and not view:
            pos = positions[i] if i < len(positions) else i
            if passes and not (pos > 0 and (name in _PASS_ONLY_FIRST or alpha != 1)):
                outs.append(mem.ref(g0))
                continue
        outs.append(mem.alloc(nbytes))
    return outs


def _from_expanded(
    mem: Memory, g0: int, kind: int, name: str, edges: list, positions: list, gbytes: list, grad_scale, alpha
) -> list:
    """:func:`outputs` when the one incoming gradient ``g0`` is a stride-0 expand (``sum()``'s gradient):
    a pass-through formula (``add``, ``clone``) sends that same tensor, a view formula a view of it, which
    stays stride 0; nothing is allocated at the full size (NOTE [what one node does to memory])."""
    tag = mem.impl_view[g0]
    outs = []
    for j, (u, k) in enumerate(edges):
        if kind & 6:  # pieces of it (cat), or expanded again (sum): views, still expanded
            outs.append(mem.view(g0, "expand0" if tag == "expand0" or name == "SumBackward0" else "expand"))
            continue
        if name in STRIDE_VIEWS or (name in _RESHAPES and tag == "expand0"):
            outs.append(mem.view(g0, tag))
            continue
        pos = positions[j] if j < len(positions) else j
        if kind & 8 and name != "ToCopyBackward0" and not (pos > 0 and (name in _PASS_ONLY_FIRST or alpha != 1)):
            outs.append(mem.ref(g0))
            continue
        nbytes = gbytes[u][k] if k < len(gbytes[u]) else 0
        outs.append(mem.alloc(grad_scale(u, k, nbytes) if grad_scale is not None else nbytes))
    return outs


def _from_one(
    mem: Memory, g0: int, kind: int, name: str, edges: list, positions: list, gbytes: list, alpha, as_view
) -> list:
    """:func:`outputs` of a formula with one incoming gradient ``g0`` and unscaled sizes."""
    refs, storage, views_of, st_refs = mem.impl_refs, mem.impl_storage, mem.impl_view, mem.st_refs
    st = storage[g0]
    views = kind & 7  # views of the incoming gradient (``Memory.view``, inlined), or the gradient itself
    tag = "expand0" if name == "SumBackward0" else "expand" if kind & 2 else "view"
    new_id = mem.ids.__next__
    if kind & 6:  # pieces of it, or an expand of it: whatever the sizes
        n = len(edges)
        st_refs[st] += n
        outs = [new_id() for _ in range(n)]
        for i in outs:
            refs[i] = 1
            storage[i] = st
            views_of[i] = tag
        return outs
    in_bytes = mem.st_bytes.get(st, -1)
    outs = []
    for j, (u, k) in enumerate(edges):
        gb = gbytes[u]
        nbytes = gb[k] if k < len(gb) else 0
        if views and (nbytes == in_bytes if as_view is None else as_view):
            i = new_id()
            st_refs[st] += 1
            refs[i] = 1
            storage[i] = st
            views_of[i] = tag
            outs.append(i)
            continue
        if nbytes == in_bytes and not views:
            pos = positions[j] if j < len(positions) else j
            if not (pos > 0 and (name in _PASS_ONLY_FIRST or alpha != 1)):
                refs[g0] += 1
                outs.append(g0)
                continue
        outs.append(mem.alloc(nbytes))
    return outs
