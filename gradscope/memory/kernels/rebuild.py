"""A node's backward, run again on fresh CPU tensors from its signature (NOTE [in-node memory]).

For a built-in node (``AddmmBackward0``) the op's forward is found among ``torch.ops.aten`` by the node's
name and the names of its saved slots and values, called on fresh tensors laid out as the signature says
(shape, strides, dtype), and the backward is run with ``torch.autograd.grad`` on gradients in the
recorded layout. The rebuilt node must have the recorded name, else the measurement is refused. A custom
``autograd.Function``'s backward is user code: it is run here on real random tensors (``custom.py``) only
when the caller asks for it (``run_custom=True``); by default it runs on fake tensors (``fake.py``).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from gradscope.memory.kernels.tensors import Unmeasurable, make_tensor, root, torch_dtype

__all__ = ["Unmeasurable", "prepare", "SAME_FORMULA"]


_NAME = re.compile(r"^(.*)Backward(\d+)$")
_ELEMENT = re.compile(r"\[(\d+)\]$")
_SUFFIXES: tuple[str, ...] = ("_sym_sizes_opt", "_sym_sizes", "_sizes", "_sym_argsize_0", "_sym_argsize_1",
                              "_sym_strides", "_options", "_scalar_type", "_dim", "_sym_numel", "_numel",
                              "_args_sizes_symint", "_args_scalartypes", "_info")  # fmt: skip
#: Nodes of an in-place op whose formula is the out-of-place op's: measured by rebuilding that one
#: (``as_strided_``: ``as_strided_backward`` for both).
SAME_FORMULA = {"AsStridedBackward1": "AsStridedBackward0"}


#: The return types of a forward whose outputs can receive gradients here (``split`` returns a list).
_RETURNS = ("Tensor", "List[Tensor]")


def _snake(camel: str) -> str:
    s = re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()
    return re.sub(r"(\d)_d(?=_|$)", r"\1d", s)


def _candidates(node_name: str) -> list:
    m = _NAME.match(SAME_FORMULA.get(node_name, node_name))
    if m is None:
        return []
    base = _snake(m.group(1))
    names = [base, "_" + base, base + "_forward", "_" + base + "_forward"]
    out = []
    for n in names:
        for s in _schemas(n):
            if s.returns and all(str(r.type) in _RETURNS for r in s.returns) and not _writes(s):
                out.append((n, s))
    return out


def _schemas(name: str) -> list:
    """Every overload's schema of ``torch.ops.aten.<name>`` (``[]`` when there is no such operator)."""
    try:
        packet = getattr(torch.ops.aten, name)
        return [getattr(packet, ov)._schema for ov in packet.overloads()]
    except (AttributeError, RuntimeError):
        return []


def _writes(schema) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _base(key: str) -> str:
    for suf in _SUFFIXES:
        if key.endswith(suf):
            return key[: -len(suf)]
    return key


def _resolve(sig: dict):
    """The aten overload whose arguments explain the node's saved slots and values best."""
    saved = {_ELEMENT.sub("", s[0]) for s in sig["saved"] if not s[0].startswith("result")}  # indices[0]: indices
    best, best_score = None, -1.0
    for name, schema in _candidates(sig["op"]):
        args = {a.name for a in schema.arguments}
        attrs = {k if k in args else _base(k) for k in sig["attrs"]}
        if not saved <= args | {r.name for r in schema.returns} or not attrs <= args:
            continue
        kinds = {a.name: "Tensor" in str(a.type) for a in schema.arguments}
        if any(not kinds.get(n, True) for n in saved) or any(kinds[k] for k in sig["attrs"] if k in kinds):
            continue  # a saved tensor must be a tensor argument, a saved value a non-tensor one
        n_tensors = sum(1 for a in schema.arguments if "Tensor" in str(a.type))
        lists = any(str(a.type).startswith("List[") and "Tensor" in str(a.type) for a in schema.arguments)
        if not lists and any(i[0] >= max(n_tensors, 1) for i in sig["inputs"]):
            continue
        score = len(saved) + len(attrs) - 0.01 * len(args)
        if score > best_score:
            best, best_score = (name, schema), score
    if best is None:
        raise Unmeasurable(f"no torch operator matches {sig['op']}'s saved values")
    name, schema = best
    return getattr(getattr(torch.ops.aten, name), schema.overload_name or "default"), schema


def _bound(sig: dict) -> int:
    """Where integer tensors (indices, targets) take their values: below a recorded argument size (an
    embedding's rows), else below every dimension of the float tensors, so that any index is valid."""
    sizes = [v for k, v in sig["attrs"].items() if k.endswith("_sym_argsize_0") and isinstance(v, int)]
    if sizes:
        return max(1, min(sizes))
    dims = [int(n) for s in sig["saved"] if s[3].startswith(("float", "bfloat")) for n in s[1]]
    dims += [int(n) for g in sig["grads"] for n in g[1]]
    return max(1, min((n for n in dims if n > 1), default=1))


def _value(arg, value):
    text = str(arg.type)
    if text.startswith("ScalarType") and isinstance(value, str):
        return torch_dtype(value)
    if text.startswith("MemoryFormat") and isinstance(value, str):
        return getattr(torch, value)
    if text.startswith("Device") and isinstance(value, str):
        return torch.device("cpu")
    if text.startswith("Layout") and isinstance(value, str):
        return getattr(torch, value)
    return value


_NEUTRAL = {"float": 1e-5, "number": 1e-5, "bool": False, "int": 0}


def _list_shapes(sig: dict, start: int) -> list:
    """Shapes of a tensor list argument (``cat``) from the inputs that need a gradient; the others share
    what is left of the output along ``dim``."""
    known = {i[0] - start: i[1] for i in sig["inputs"] if i[0] >= start}
    out = sig["grads"][0][1] if sig["grads"] else None
    if not known or out is None:
        raise Unmeasurable(f"the sizes of {sig['op']}'s tensor list are not recorded")
    n = max(known) + 1
    dim = int(sig["attrs"].get("dim", 0)) % max(len(out), 1)
    rest = int(out[dim]) - sum(int(known[j][dim]) for j in known if len(known[j]) == len(out))
    missing = [j for j in range(n) if j not in known] or ([n] if rest > 0 else [])
    shapes = []
    for j in range(max(n, max(missing, default=0) + 1)):
        if j in known:
            shapes.append(known[j])
        else:  # what is left, shared (an empty piece when nothing is: a key cache's empty past)
            i = missing.index(j)
            size = max(0, rest) // len(missing) + (1 if i < max(0, rest) % len(missing) else 0)
            shapes.append([size if d == dim else int(x) for d, x in enumerate(out)])
    return shapes


def _sizes(attrs: dict, name: str) -> list | None:
    """The recorded sizes of a tensor argument that was not saved (``bias_sym_sizes_opt``...)."""
    for key in (name + "_sym_sizes", name + "_sizes", name + "_sym_sizes_opt"):
        got = attrs.get(key)
        if isinstance(got, list) and got != [0] and all(isinstance(n, int) for n in got):
            return got
    return None


def _args(sig: dict, schema) -> tuple[list, dict, list]:
    """The forward's positional and keyword arguments and the leaves that need a gradient."""
    t: torch.Tensor | None
    args: list[Any]
    saved = {s[0]: s for s in sig["saved"]}
    inputs = {i[0]: i for i in sig["inputs"]}
    attrs = sig["attrs"]
    out0 = sig["grads"][0] if sig["grads"] else None
    args, kwargs, leaves, pos = [], {}, [], 0
    bound = _bound(sig)
    for a in schema.arguments:
        if a.kwarg_only:
            if a.name in attrs:
                kwargs[a.name] = _value(a, attrs[a.name])
            elif not a.has_default_value() and "Tensor" not in str(a.type):
                raise Unmeasurable(f"{sig['op']}'s argument {a.name!r} is not recorded")
            continue
        text = str(a.type)
        listed = sorted((int(m.group(1)), v) for k, v in saved.items() if (m := _ELEMENT.search(k)) and
                        k[: m.start()] == a.name)  # fmt: skip
        if listed:  # a list saved element by element (index's indices)
            args.append([make_tensor(v[1], v[3], v[2], False, bound) for _, v in listed])
            pos += len(listed)
            continue
        if text in ("List[Tensor]", "List[Optional[Tensor]]"):
            shapes = attrs.get(a.name + "_args_sizes_symint") or attrs.get(a.name + "_args_sizes")
            dts = attrs.get(a.name + "_args_scalartypes") or []
            if not isinstance(shapes, list):
                shapes = _list_shapes(sig, pos)
            lst = []
            for j, shp in enumerate(shapes):
                need = pos + j in inputs
                t = make_tensor(shp, dts[j] if j < len(dts) else "float32", None, need)
                lst.append(t)
                if need:
                    leaves.append(t)
            pos += len(shapes)
            args.append(lst)
            continue
        if "Tensor" in text:
            need = pos in inputs
            if a.name in saved:
                s = saved[a.name]
                t = make_tensor(s[1], s[3], s[2], need and not s[4], bound)
            elif need:
                t = make_tensor(inputs[pos][1], inputs[pos][2], inputs[pos][3], True)
            elif _sizes(attrs, a.name) is not None:
                t = make_tensor(_sizes(attrs, a.name), out0[3] if out0 else "float32")
            elif text.startswith("Optional["):
                t = None
            elif out0 is not None:
                t = make_tensor(out0[1], out0[3])
            else:
                raise Unmeasurable(f"the shape of {sig['op']}'s input {a.name!r} is not recorded")
            pos += 1
            if need and t is not None and t.requires_grad:
                leaves.append(t)
            args.append(t)
            continue
        if a.name in attrs:
            args.append(_value(a, attrs[a.name]))
        elif a.has_default_value():
            args.append(a.default_value)
        elif a.name in ("size", "shape") and out0 is not None:
            args.append(list(out0[1]))
        elif text in _NEUTRAL:  # not saved, so the backward never reads it (layer norm's eps)
            args.append(_NEUTRAL[text])
        else:
            raise Unmeasurable(f"{sig['op']}'s argument {a.name!r} is not recorded")
    return args, kwargs, leaves


def _grads(sig: dict) -> dict:
    return {g[0]: make_tensor(g[1], g[3], g[2]) for g in sig["grads"]}


def _builtin(sig: dict):
    op, schema = _resolve(sig)
    args, kwargs, leaves = _args(sig, schema)
    if not leaves:
        raise Unmeasurable(f"{sig['op']} has no input that needs a gradient here")
    with torch.enable_grad():
        out = op(*args, **kwargs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    fn = next((o.grad_fn for o in outs if isinstance(o, torch.Tensor) and o.grad_fn is not None), None)
    if fn is None or type(fn).__name__ != SAME_FORMULA.get(sig["op"], sig["op"]):
        got = "no node" if fn is None else type(fn).__name__
        raise Unmeasurable(f"rebuilding {sig['op']} made {got}")
    grads = _grads(sig)
    pairs = [(outs[k], g) for k, g in grads.items() if k < len(outs) and outs[k].requires_grad]
    if not pairs:
        raise Unmeasurable(f"{sig['op']}'s outputs receive no gradient")

    # a scalar root, made here (run() is only the backward): no grad_outputs, or torch.autograd.grad would
    # import sympy to check them; sum() sends an expanded gradient itself, (out * g).sum() one laid out as g
    # (TensorIterator follows g's dimension order), and a g with gaps (a slice of a larger gradient, from
    # cat) is sent as it is; the gradient is the engine's own, as one between two nodes is
    with torch.enable_grad():
        total = torch.stack([root(o, g) for o, g in pairs]).sum() if len(pairs) > 1 else root(*pairs[0])

    def run():
        run.outputs = pairs  # type: ignore[attr-defined]  # alive through the backward, as before it
        return torch.autograd.grad(total, leaves, allow_unused=True)

    return run


#: NOTE [in-place on a slice] (tracing/probes.py); docs/memory.md "Accuracy".
_HIDDEN = (
    "an in-place write through a view (CopySlices) hides the node of the write: its backward's temporaries "
    "(a copy of the written slice's gradient and the hidden node's own) are not visible, nor the tensors it "
    "saved (freed here, so the levels after it can be higher than torch's)"
)


def prepare(sig: dict, run_custom: bool):
    """A callable that runs the node's backward once on fresh tensors (its result kept by the caller).

    Raises:
        Unmeasurable: the node cannot be rebuilt; the message says why.
    """
    if sig["op"] == "CopySlices":
        raise Unmeasurable(_HIDDEN)
    if sig.get("function"):
        if not run_custom:
            raise Unmeasurable(
                f"the backward of the custom autograd.Function {sig['function']} is user code; pass "
                "run_custom=True to run it on random tensors and measure it"
            )
        try:
            from gradscope.memory.kernels.custom import custom_run

            return custom_run(sig)
        except Unmeasurable:
            raise
        except Exception as e:  # noqa: BLE001 - user code: any failure means "not measured"
            raise Unmeasurable(f"running {sig['function']}.backward on random tensors failed: {e}") from None
    try:
        return _builtin(sig)
    except Unmeasurable:
        raise
    except Exception as e:  # noqa: BLE001 - torch refuses the rebuilt arguments: not measured, said why
        raise Unmeasurable(
            f"{sig['op']} could not be rebuilt on random tensors: {str(e).splitlines()[0][:160]}"
        ) from None
