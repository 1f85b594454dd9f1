"""A reentrant checkpoint's backward, modelled from the layers its region runs (nothing is run).

NOTE [reentrant checkpoint backward] (docs/internals.md#reentrant-checkpoint, #engine-order)
``CheckpointFunctionBackward`` (``checkpoint(fn, x, use_reentrant=True)``) does, inside one node of the
outer backward: ``fork_rng`` (a copy of the CPU generator state, freed when the recompute is done), the
region's forward again under ``enable_grad`` on a detached input (its activations and the graph's saved
tensors), then a nested ``torch.autograd.backward(outputs, incoming_grads)`` over that fresh graph (it
fills the region's parameter ``.grad`` and the detached input's ``.grad``), and returns the input's grad;
the recomputed output dies when the node returns. None of this exists before backward, but when the
region is an ``nn.Sequential`` of torch's own layers (``walk/checkpoint.py`` NOTE [reentrant layers]) the
recomputed graph follows from the layers: this module builds it as an :class:`engine.Program` (nodes,
sequence numbers in creation order, edges, saved storages) and replays it with the same engine rules
(``replay.simulate``: order, InputBuffers, AccumulateGrad stealing or adding in place, saved tensors
released as nodes run). The nested graph's seed is the outer node's incoming gradient: it exists already
and is not freed by the nested backward. What is not modelled: kernel workspace inside the nested nodes
(none of the layers modelled here has any on CPU), batch scaling (``Overrides.scale``), and any other
region (a custom ``forward``): for those the outer node only allocates the parameters' gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradscope.memory.replay.dtypes import numel_bytes
from gradscope.memory.replay.engine import node_extras

__all__ = ["NestedEffect", "nested_effect", "node_effect", "modelled_region"]

_U64 = (1 << 64) - 1
#: Activations whose backward node saves its result (the others save their input).
_SAVES_RESULT = frozenset({"ReluBackward0", "TanhBackward0", "SigmoidBackward0"})
_SAVES_INPUT = frozenset({"GeluBackward0", "SiluBackward0"})


@dataclass(frozen=True)
class NestedEffect:
    """What one reentrant checkpoint node's recompute and nested backward do, relative to its start.

    Attributes:
        forward_peak: highest point of the recompute (the RNG state copy included).
        peak: highest point of the nested backward (the recomputed activations included).
        end: bytes still allocated when the node returns (the parameters' new ``.grad``s, the input's grad).
        input_grad: bytes of the input's gradient among ``end`` (the grad the node sends on).
        grads_kept: bytes that ended in a parameter's ``.grad``.
        names: the nested graph's node names in the order the engine runs them.
    """

    forward_peak: int
    peak: int
    end: int
    input_grad: int
    grads_kept: int
    names: tuple


class _Builder:
    """The recomputed graph as the flat lists of :class:`engine.Program`."""

    def __init__(self) -> None:
        self.name: list = []
        self.seq: list = []
        self.leaf: list = []
        self.edges: list = []
        self.needs: list = []
        self.gbytes: list = []
        self.saved: list = []
        self.has_grad: dict = {}
        self.storages: dict = {}
        self.next_seq = 0

    def node(self, name, out_bytes, edges=(), saved=(), leaf=False, had=False) -> int:
        i = len(self.name)
        self.name.append("AccumulateGrad" if leaf else name)
        self.seq.append(_U64 if leaf else self.next_seq)
        if not leaf:
            self.next_seq += 1
        self.leaf.append(leaf)
        self.edges.append([(u, 0) for u in edges if u is not None])
        self.needs.append([p for p, u in enumerate(edges) if u is not None])
        self.gbytes.append([out_bytes])
        self.saved.append(tuple(saved))
        if leaf:
            self.has_grad[i] = had
        return i


_VIEW_NAMES: dict[bool, str] = {}


def _out_view(with_bias: bool) -> str:
    """The view node ``F.linear`` leaves over its ``addmm`` (``mm`` without bias) for a 3-d input on this
    torch: ``ViewBackward0`` with bias, ``UnsafeViewBackward0`` without, on torch 2.13; torch 2.15 records
    ``UnsafeViewBackward0`` for both. Asked of torch once per case, on ``meta`` (nothing is computed)."""
    name = _VIEW_NAMES.get(with_bias)
    if name is None:
        import torch

        x = torch.empty(2, 2, 3, device="meta", requires_grad=True)
        w = torch.empty(4, 3, device="meta")
        bias = torch.empty(4, device="meta") if with_bias else None
        name = _VIEW_NAMES[with_bias] = type(torch.nn.functional.linear(x, w, bias).grad_fn).__name__
    return name


def _linear(b: _Builder, spec, x, shape, save):
    """``F.linear`` as autograd records it: ``t()``, ``addmm`` (``mm`` without bias), views around it for
    inputs of more than two dimensions. Returns ``(producer, output shape)``."""
    _, n_in, n_out, dtype, with_bias, w_rg, w_had, b_rg, b_had = spec
    out_shape = [*shape[:-1], n_out]
    nd = len(shape) > 2
    in_bytes, rows = numel_bytes(shape, dtype), numel_bytes(out_shape, dtype)
    w = b.node("", numel_bytes([n_out, n_in], dtype), leaf=True, had=w_had) if w_rg else None
    bias = b.node("", numel_bytes([n_out], dtype), leaf=True, had=b_had) if b_rg else None
    src = b.node("ViewBackward0", in_bytes, [x]) if nd and with_bias else x
    t = b.node("TBackward0", numel_bytes([n_in, n_out], dtype), [w]) if w is not None else None
    if nd and not with_bias:
        src = b.node("ViewBackward0", in_bytes, [x])
    if with_bias:
        mm = b.node("AddmmBackward0", rows, [bias, src, t], saved=save)
    else:
        mm = b.node("MmBackward0", rows, [src, t], saved=save)
    if nd:
        mm = b.node(_out_view(with_bias), rows, [mm])
    return mm, out_shape


def _build(layers, in_shape, in_dtype: str, input_grad: bool, rng_bytes: int):
    """``(builder, root, forward_peak, kept, output key, output bytes)``, or None outside what is modelled."""
    b = _Builder()
    shape, dtype = list(in_shape), in_dtype
    x = b.node("", numel_bytes(shape, dtype), leaf=True) if input_grad else None  # the detached input
    level = high = rng_bytes  # fork_rng's copy of the generator state, then the recompute's outputs
    cur = None  # storage key of the current value (None: the region's input, which exists already)
    saved: set = set()
    for k, spec in enumerate(layers):
        out_key = ("n", k)  # not "r": those are non-reentrant recompute keys (created at first unpack)
        if spec[0] == "linear":
            if len(shape) < 2 or shape[-1] != spec[1]:
                return None
            dtype = spec[3]
            save = cur  # addmm / mm save their input (and weight.t(), a view of the parameter)
            x, shape = _linear(b, spec, x, shape, [cur] if cur is not None else [])
        elif spec[0] in _SAVES_RESULT or spec[0] in _SAVES_INPUT:
            save = out_key if spec[0] in _SAVES_RESULT else cur
            x = b.node(spec[0], numel_bytes(shape, dtype), [x], saved=[save] if save is not None else [])
        else:
            return None
        if save is not None:
            saved.add(save)
        b.storages[out_key] = out_bytes = numel_bytes(shape, dtype)
        level += out_bytes
        high = max(high, level)
        if cur is not None and cur not in saved:  # Sequential rebinds its variable: the old value dies
            level -= b.storages[cur]
        cur = out_key
    return b, len(b.name) - 1, high, level - rng_bytes, cur, b.storages.get(cur, 0)


def nested_effect(layers, in_shape, in_dtype: str, input_grad: bool, rng_bytes: int, simulate) -> NestedEffect | None:
    """The recompute and nested backward of a region made of ``layers`` (``walk.checkpoint.region_layers``)
    on an input of ``in_shape``, replayed by ``simulate`` (``replay.simulate``, passed in: it calls us);
    None when a layer or shape is outside what is modelled."""
    from gradscope.memory.replay.engine import Program

    built = _build(layers, in_shape, in_dtype, input_grad, rng_bytes) if layers and in_shape else None
    if built is None:
        return None
    b, root, forward_peak, kept, out_key, out_bytes = built
    n = len(b.name)
    prog = Program(
        ids=list(range(n)),
        index={i: i for i in range(n)},
        name=b.name,
        seq=b.seq,
        leaf=b.leaf,
        edges=b.edges,
        grad_bytes=b.gbytes,
        grad_shapes=[[None]] * n,
        saved=b.saved,
        storages={k: v for k, v in b.storages.items() if any(k in keys for keys in b.saved)},
        shapes={},
        external={out_key},  # the recomputed output is held by the node's ``outputs`` until it returns
        has_grad=b.has_grad,
        roots=[root],
        root_bytes=[0],  # the outer node's incoming gradient: allocated already, held by the outer engine
        module=[None] * n,
        attrs=[{}] * n,
        needs=b.needs,
        extra={},
    )
    tr = simulate(prog)
    in_grad = numel_bytes(in_shape, in_dtype) if input_grad else 0
    return NestedEffect(
        forward_peak=forward_peak,
        peak=kept + tr.peak,
        end=kept + tr.end - out_bytes,
        input_grad=in_grad,
        grads_kept=tr.grads_kept - in_grad,
        names=tuple(b.name[v] for v in tr.order),
    )


def modelled_region(extra_attrs: dict) -> dict | None:
    """The ``region_recompute`` record of a reentrant checkpoint node's ``attrs`` when its layers are known
    (NOTE [reentrant layers]) or its forward was traced (``memory/replay/traced.py``), else None: a region this
    module can replay (a traced one may still fail on meta: :func:`node_effect` is then None)."""
    from gradscope.memory.replay.traced import usable

    rec = extra_attrs.get("region_recompute")
    return rec if rec and (rec.get("layers") or usable(rec)) else None


def node_effect(prog, v: int, recompute: dict, simulate, given: set | None = None) -> NestedEffect | None:
    """:func:`nested_effect` of the reentrant checkpoint node ``v`` of ``prog`` (cached on the program).

    ``given``: names of the parameters whose ``.grad`` this backward has set before ``v`` runs (a traced
    region's AccumulateGrad then adds in place; the set gets the region's parameters)."""
    cache = prog.__dict__.setdefault("_nested", {})
    if not recompute.get("layers"):  # a traced region (NOTE [traced reentrant regions])
        from gradscope.memory.replay.traced import region_params, traced_effect

        names = region_params(recompute)
        key = (v, frozenset(names & given) if given else frozenset())
        if key not in cache:
            fields = traced_effect(recompute, simulate, key[1])
            cache[key] = None if fields is None else NestedEffect(**fields)
            if not key[1]:
                cache[v] = cache[key]
        if given is not None and cache[key] is not None:
            given.update(names)
        return cache[key]
    if v in cache:
        return cache[v]
    tensors = [e for e in prog.attrs[v].get("saved") or () if e.get("shape") is not None and not e.get("scalar")]
    eff = None
    if len(tensors) == 1:  # one tensor argument: the region's input
        e = tensors[0]
        layers = recompute.get("layers") or ()
        args = (
            tuple(tuple(layer) for layer in layers),
            tuple(e["shape"]),
            e.get("dtype") or "float32",
            bool(prog.edges[v]),
            int(recompute.get("rng_bytes") or 0),
        )
        eff = _EFFECTS.get(args)  # a pure function of plain data: repeated blocks are modelled once
        if eff is None:
            eff = nested_effect(layers, list(e["shape"]), *args[2:], simulate)
            if len(_EFFECTS) < 4096:
                _EFFECTS[args] = eff
    cache[v] = eff
    return eff


_EFFECTS: dict = {}


def ctx_state_bytes(prog) -> int:
    """Bytes of the CPU generator states that reentrant checkpoint nodes keep from the forward
    (``ctx.fwd_cpu_state``): alive before backward and not freed by it (the node outlives it)."""
    return sum(int((a["region_recompute"] or {}).get("rng_bytes") or 0)
               for a in node_extras(prog) if a and "region_recompute" in a)  # fmt: skip
