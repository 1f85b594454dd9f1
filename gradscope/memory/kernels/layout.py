"""The layout (strides) of the gradient each backward node receives, read from the graph.

NOTE [gradient layout] (docs/internals.md#gradient-layout)
A backward formula does not always send a dense, contiguous gradient. A transpose or permute sends a
view of the gradient it received with its dimensions swapped back; ``cat`` sends narrowed pieces of its
gradient (a piece keeps the whole gradient's strides); ``sum()`` a stride-0 expand; a reshape
(``view``, ``flatten``) sends ``grad.reshape(sizes)``, which is a view when torch's ``computeStride``
finds strides for the new shape and a fresh contiguous copy otherwise; a pointwise formula lays its
output out as its inputs (TensorIterator). So ``x.flatten(2).transpose(1, 2)`` after a convolution (a
ViT or PVT patch embedding) hands the convolution's backward a channels-last-strided gradient, and a
``permute(...).reshape(...)`` of attention heads hands the reshape's backward a gradient it must copy.
The kernel that receives such a gradient may copy it again (a convolution's or layer norm's backward
makes it contiguous, inside the node), so both the in-node measurement (the signature's gradient
strides) and the replay (is this reshape a view or a copy?) read the layout worked out here, following
each gradient from the consumer that sends it, up to :data:`DEPTH` consumers back.
"""

from __future__ import annotations

from gradscope.memory.kernels.facts import facts
from gradscope.memory.kernels.reuse import derived

__all__ = [
    "contiguous",
    "grad_stride",
    "layout_of_view_op",
    "reshape_stride",
    "reshape_views",
    "layout_clones",
    "consumers_of",
    "RESHAPES",
    "CONTIGUOUS_OUT",
    "DEPTH",
    "VIEW_OPS",
]

#: How many consumers back a gradient's layout is followed (further: unknown, read as contiguous).
DEPTH = 16

_SUMS = ("SumBackward0",)
_TRANSPOSES = ("TransposeBackward0", "TransposeBackward1")
#: The formulas :func:`layout_of_view_op` answers for (a transpose or permute of the gradient).
VIEW_OPS = frozenset({*_TRANSPOSES, "PermuteBackward0", "TBackward0"})
#: Formulas that send ``grad.reshape(input sizes)``: a view when the strides allow it, else a copy.
RESHAPES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})
_VIEWS = RESHAPES | {"SqueezeBackward0", "UnsqueezeBackward0"}
#: Formulas that send each input a slice of the gradient they received: ``cat`` a narrowed piece (the
#: whole gradient's strides), ``stack`` one ``select`` (those strides without its ``dim``).
_PIECES = ("CatBackward0", "StackBackward0")
#: Formulas whose gradients are new contiguous tensors whatever the layouts they read (``mean``'s is its
#: gradient expanded then divided: TensorIterator lays out a stride-0 input contiguously).
CONTIGUOUS_OUT = frozenset({"NativeLayerNormBackward0", "BmmBackward0", "MeanBackward0", "MeanBackward1"})
#: Matrix products: an input's gradient is column-major when that input was (``mm_mat1_backward``,
#: ``mm_mat2_backward``: the recorded ``<arg>_sym_strides``), else contiguous; the arguments by position.
_MATMULS = {"MmBackward0": ("self", "mat2"), "AddmmBackward0": ("self", "mat1", "mat2")}


def contiguous(shape: list) -> list:
    """Contiguous strides of ``shape``."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return out[::-1]


def _dense_or_none(shape: list, stride: list | None) -> list | None:
    """``stride``, or None when it is contiguous (size-1 dimensions' strides do not count, as in torch)."""
    if stride is None:
        return None
    want = contiguous(shape)
    if all(int(n) == 1 or a == b for n, a, b in zip(shape, stride, want)):
        return None
    return list(stride)


def reshape_stride(shape: list, stride: list, new_shape: list) -> list | None:
    """Strides of ``t.reshape(new_shape)`` for ``t`` of ``shape`` / ``stride`` when it is a view, None when
    torch copies (ATen's ``computeStride``)."""
    shape, new_shape = [int(n) for n in shape], [int(n) for n in new_shape]
    numel = 1
    for n in shape:
        numel *= n
    if numel == 0 or not shape:
        return contiguous(new_shape)
    new = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    base = stride[-1]
    t_numel = v_numel = 1
    for d in range(len(shape) - 1, -1, -1):
        t_numel *= shape[d]
        if d == 0 or (shape[d - 1] != 1 and stride[d - 1] != t_numel * base):
            while view_d >= 0 and (v_numel < t_numel or new_shape[view_d] == 1):
                new[view_d] = v_numel * base
                v_numel *= new_shape[view_d]
                view_d -= 1
            if v_numel != t_numel:
                return None
            if d > 0:
                base = stride[d - 1]
                t_numel = v_numel = 1
    return new if view_d == -1 else None


def _permuted(dims: list, y_stride: list) -> list:
    """Strides of ``grad_y.permute(inverse(dims))``: the gradient of ``x`` where ``y = x.permute(dims)``."""
    out = [0] * len(dims)
    for i, d in enumerate(dims):
        out[d] = y_stride[i]
    return out


def _swapped(stride: list, d0: int, d1: int) -> list:
    out = list(stride)
    out[d0], out[d1] = out[d1], out[d0]
    return out


def layout_of_view_op(prog, u: int, shape: list, up: list | None = None) -> list | None:
    """Strides of the gradient that node ``u``, a transpose or permute, sends for an input of ``shape``,
    given the strides ``up`` of the gradient it received (None: contiguous); None when ``u`` is not one."""
    name = prog.name[u]
    if name not in VIEW_OPS or not shape or prog.leaf[u]:
        return None
    n = len(shape)
    a = facts(prog).values(u) if name in _TRANSPOSES or name == "PermuteBackward0" else {}
    if name == "PermuteBackward0" and isinstance(a.get("dims"), list) and len(a["dims"]) == n:
        dims = [int(d) % n for d in a["dims"]]
        return _permuted(dims, up if up is not None else contiguous([shape[d] for d in dims]))
    if name in _TRANSPOSES and "dim0" in a and "dim1" in a:
        d0, d1 = int(a["dim0"]) % n, int(a["dim1"]) % n
        return _swapped(up if up is not None else contiguous(_swapped(shape, d0, d1)), d0, d1)
    if name == "TBackward0" and n == 2:
        return _swapped(up if up is not None else contiguous([shape[1], shape[0]]), 0, 1)
    return None


def grad_stride(prog, consumers: dict, v: int, k: int, shape: list) -> list | None:
    """Strides of the gradient node ``v`` receives for output ``k`` (None: contiguous or not known), see
    NOTE [gradient layout]."""
    got = _memo(prog).get((v, k))
    return (got if got is not None else _layout(prog, consumers, v, k, shape, 0))[0]


def _memo(prog) -> dict:
    """The layouts worked out so far, ``(node, output) -> (strides, known)`` (the structure's, kept on
    ``prog``)."""
    memo = prog.__dict__.get("_layouts")
    if memo is None:
        memo = prog.__dict__["_layouts"] = derived(prog).setdefault("grad layouts", {})
    return memo


def _layout(prog, consumers: dict, v: int, k: int, shape: list, depth: int) -> tuple:
    """:func:`_sent` memoized on the program (which nothing changes, in ``prog._layouts``, which
    :func:`grad_stride` sets and looks up first); several gradients for one output are summed (in place
    into the first, or ``old + new``): known when they all have one known layout."""
    memo = _memo(prog)
    got = memo.get((v, k))
    if got is not None:
        return got
    users: list = consumers.get((v, k)) or []
    if not users and k == 0 and v in prog.roots:
        got = (None, True)  # backward's seed, ones_like(loss)
    elif not users or depth > DEPTH:
        got = (None, False)
    else:
        got = _sent(prog, consumers, v, users[0], shape, depth)
        for c in users[1:]:
            if got != (None, False) and _sent(prog, consumers, v, c, shape, depth) != got:
                got = (None, False)
        if len(users) > 1 and not got[1]:
            got = (None, False)
    memo[(v, k)] = got
    return got


def _sent(prog, consumers: dict, v: int, c: int, shape: list, depth: int) -> tuple:
    """``(strides or None, known)`` of the gradient of ``shape`` that consumer ``c`` sends ``v``: its strides
    (None: contiguous), and whether they are known for certain (every formula on the way is one whose
    output layout torch fixes: a view, a piece, a pointwise formula, the seed, :data:`CONTIGUOUS_OUT`),
    not only read as contiguous for want of better. A pointwise formula (output shaped as its gradient)
    follows the layout of the gradient it received, or, when that one is expanded, of the tensor it saved
    with that shape."""
    name = prog.name[c]
    out = (prog.grad_shapes[c] or [None])[0]
    if out is None:
        up, known = None, False
    else:
        hit = _memo(prog).get((c, 0))
        up, known = hit if hit is not None else _layout(prog, consumers, c, 0, list(out), depth + 1)
    if name in VIEW_OPS:
        via = layout_of_view_op(prog, c, shape, up)
        if via is not None:
            return via, known
    if name in _SUMS and not facts(prog).values(c).get("dim"):
        return [0] * len(shape), True
    if name in CONTIGUOUS_OUT:
        return None, True
    if name in _MATMULS:
        return _matmul(prog, c, v, shape)
    if out is None:
        return None, False
    if name in _VIEWS:  # a view of the gradient of a view: reshaped when it can be, else a copy
        if up is None:
            return (None, True) if known else (_own_output_stride(prog, v, shape), False)
        return _dense_or_none(shape, reshape_stride(list(out), up, shape)), known
    if name in _PIECES:  # a slice keeps the whole gradient's strides (stack: but for its dim)
        whole = up if up is not None else contiguous(list(out))
        if name == "StackBackward0":
            dim = int(facts(prog).values(c).get("dim", 0)) % max(len(out), 1)
            whole = whole[:dim] + whole[dim + 1 :]
        if len(whole) != len(shape):
            return None, False
        return _dense_or_none(shape, whole), known
    if list(out) != list(shape) or not _pointwise(prog, c, shape):  # ``shape`` is ``c``'s own here
        return None, False
    if up is None or any(up):
        return up, known
    for _, sh, st, *_ in facts(prog).slots(c):
        if sh is not None and list(sh) == list(shape):
            return (list(st) if st else None), False
    return up, False


def _matmul(prog, c: int, v: int, shape: list) -> tuple:
    """``(strides or None, known)`` of the gradient matrix product ``c`` sends ``v`` (an addmm's ``self``,
    the bias, is not known: summed to its shape, or the gradient itself)."""
    a = facts(prog).values(c)
    args = _MATMULS[prog.name[c]]
    found = set()
    for (u, _), pos in zip(prog.edges[c], prog.needs[c]):
        if u != v:
            continue
        arg = args[pos] if pos < len(args) else None
        st, sz = a.get(f"{arg}_sym_strides"), a.get(f"{arg}_sym_sizes")
        if (arg == "self" and len(args) == 3) or not st or not sz or len(st) != 2 or len(shape) != 2:
            return None, False
        found.add((1, int(shape[0])) if int(st[0]) == 1 and int(st[1]) == int(sz[0]) else None)
    if len(found) != 1:
        return None, False
    col = found.pop()
    return _dense_or_none(shape, list(col) if col else None), True


def _pointwise(prog, c: int, shape: list) -> bool:
    """Whether node ``c`` looks like a pointwise formula at ``shape``: every tensor it saved broadcasts to
    it (an RNN's weights or a convolution's do not), so TensorIterator lays its gradient out as its inputs.
    Kept per node: it is asked at ``c``'s own output shape."""
    memo = prog.__dict__.setdefault("_pointwise", {})
    got = memo.get(c)
    if got is None or got[0] != shape:
        got = memo[c] = (shape, _broadcasts(facts(prog).slots(c), shape))
    return got[1]


def _broadcasts(slots: list, shape: list) -> bool:
    for _, sh, *_ in slots:
        if sh is None or len(sh) > len(shape):
            return False
        if any(int(a) not in (1, int(b)) for a, b in zip(reversed(sh), reversed(shape))):
            return False
    return True


def _own_output_stride(prog, v: int, shape: list) -> list | None:
    """The strides of node ``v``'s output when it saved it (``result``, ``output``) and it is not contiguous."""
    for slot, sh, st, *_ in facts(prog).slots(v):
        if slot in ("result", "result0", "output", "out") and sh is not None and list(sh) == shape and st:
            return list(st)
    return None


def consumers_of(prog) -> dict:
    """``(node, output) -> [nodes consuming it]`` over a compiled program; built once and cached on the
    program (which nothing changes), shared by the in-node signatures, the reshapes and the clones."""
    cons: dict | None = derived(prog).get("consumers")
    if cons is None:
        cons = {}
        for u, es in enumerate(prog.edges):
            for t, k in es:
                cons.setdefault((t, k), []).append(u)
        derived(prog)["consumers"] = cons
    return cons


def reshape_views(prog) -> dict:
    """Node index -> whether its ``grad.reshape(sizes)`` is a view, for the reshape nodes whose incoming
    gradient is known not to be contiguous (the replay reads the others as views when the bytes match);
    cached on the program, which nothing changes."""
    got = derived(prog).get("reshape views")
    if got is not None:
        return got
    found: dict = {}
    cons = None
    for c, name in enumerate(prog.name):
        if name not in RESHAPES or prog.leaf[c] or not prog.grad_shapes[c] or prog.grad_shapes[c][0] is None:
            continue
        if cons is None:
            cons = consumers_of(prog)
        out = list(prog.grad_shapes[c][0])
        up, known = _layout(prog, cons, c, 0, out, 0)
        if not known or up is None or not any(up):  # contiguous, unknown, or sum()'s expand (the replay's)
            continue
        for u, k in prog.edges[c]:
            shapes = prog.grad_shapes[u]
            if k < len(shapes) and shapes[k] is not None:
                found[c] = reshape_stride(out, up, list(shapes[k])) is not None
    derived(prog)["reshape views"] = found
    return found


def _channels_last(slot: tuple) -> bool:
    """Whether a saved 4-d tensor's recorded strides (a ``facts`` slot) make torch's
    ``suggest_memory_format`` say channels-last (strides ordered N, H, W, C, and not also contiguous)."""
    shape = slot[1] or []
    stride = _dense_or_none(shape, slot[2]) if len(shape) == 4 else None
    if stride is None:
        return False
    order = sorted(range(4), key=lambda d: (-stride[d], d))
    return order == [0, 2, 3, 1]


def layout_clones(prog) -> frozenset:
    """Leaf indices whose gradient does not have the parameter's layout, so that AccumulateGrad clones it
    where it would steal it (``obeys_layout_contract``): a 2-d convolution's weight gradient is
    channels-last when its input is (docs/internals.md#convolution-layout-on-cpu), a contiguous weight's
    then cloned. Cached on the program."""
    got = derived(prog).get("layout clones")
    if got is not None:
        return got
    found = set()
    cons = None
    for c, name in enumerate(prog.name):
        if name != "ConvolutionBackward0":
            continue
        saved = {e[0]: e for e in facts(prog).slots(c)}
        inp, w = saved.get("input"), saved.get("weight")
        if not inp or not w or len(w[1] or ()) != 4 or w[2] or not _channels_last(inp):
            continue
        cons = consumers_of(prog) if cons is None else cons
        for (u, k), pos in zip(prog.edges[c], prog.needs[c]):
            if pos == 1 and prog.leaf[u] and len(cons.get((u, k)) or ()) == 1:
                found.add(u)
    derived(prog)["layout clones"] = got = frozenset(found)
    return got
