"""A recorded backward formula run again on fresh CPU tensors: how a ``CopySlices`` node is measured.

The walk records what a ``CopySlices`` node does as a list of aten calls (NOTE [CopySlices formula] in
``walk/copyslices.py``): the gradient copied into a tensor of the base's shape, the slice, its clone, the
hidden op's formula, the copy back. Here those calls run in order on a fresh gradient and fresh saved
tensors of the recorded layouts, each value dropped after its last use as the C++ code drops it at the end
of its scope or statement (close enough: every value but the formula's temporaries lives until the node
returns), the node's outputs returned, each summed to its input's shape as the engine does after the node
(``validate_outputs``). The whole call is the measured window (``measure.py``): its highest point minus the
outputs is the node's in-node memory.
"""

from __future__ import annotations

import math

import torch

from gradscope.memory.kernels.tensors import Unmeasurable, make_tensor

__all__ = ["is_formula", "prepare_formula", "FORMULA_LIMIT"]

#: A recorded formula whose largest tensor is above this is not run (it is measured at full size).
FORMULA_LIMIT = 64 * 1024 * 1024


def is_formula(sig: dict) -> bool:
    """Whether ``sig`` is a node the walk recorded as calls (a ``CopySlices``), read or not."""
    attrs = sig.get("attrs") or {}
    return "formula" in attrs or "formula_unread" in attrs


def _op(name: str):
    ns, _, rest = name.partition(".")
    packet, _, overload = rest.rpartition(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), packet), overload)
    except (AttributeError, RuntimeError):
        raise Unmeasurable(f"the recorded call {name} is not a torch operator here") from None


def _uses(calls: list) -> dict:
    """``(call, output) -> index of the last call reading it``."""
    last: dict = {}

    def walk(v, i):
        if isinstance(v, dict) and v.get("t") == "v":
            last[(v["i"], v["j"])] = i
        elif isinstance(v, list):
            for x in v:
                walk(x, i)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x, i)

    for i, (_, args, kwargs) in enumerate(calls):
        walk(args, i)
        walk(kwargs, i)
    return last


def _store(values: dict, i: int, out) -> None:
    for j, o in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
        values[(i, j)] = o


def _nbytes(spec: list) -> int:
    return math.prod(int(n) for n in spec[1]) * getattr(torch, spec[3], torch.float32).itemsize


def prepare_formula(sig: dict):
    """A callable that runs the recorded formula once (``run.direct``: the whole call is the node).

    Raises:
        Unmeasurable: the formula was not recorded, or cannot run here; the message says why.
    """
    attrs = sig.get("attrs") or {}
    formula = attrs.get("formula")
    if formula is None:
        raise Unmeasurable(f"the op inside {sig['op']} could not be read: {attrs.get('formula_unread')}")
    saved = {s[0]: s for s in sig["saved"]}
    specs = [saved.get(f"hidden[{k}]") for k in range(int(formula["hidden"]))]
    if any(s is None for s in specs) or not sig["grads"]:
        raise Unmeasurable(f"the tensors {sig['op']} saved are not all recorded")
    g0 = sig["grads"][0]
    if max(_nbytes(s) for s in [*specs, g0[:1] + g0[1:2] + [None, g0[3]]]) > FORMULA_LIMIT:
        raise Unmeasurable(f"a tensor {sig['op']} saved is above {FORMULA_LIMIT} bytes: its formula is not run")
    bound = max(1, min((int(n) for n in g0[1] if int(n) > 1), default=1))
    hidden = [make_tensor(s[1], s[3], s[2], bound=bound) for s in specs]  # type: ignore[index]
    grad = make_tensor(g0[1], g0[3], g0[2])
    calls = [(_op(name), args, kwargs) for name, args, kwargs in formula["calls"]]
    last = _uses(formula["calls"])
    keep = {(r["i"], r["j"]) for r in formula["out"] if r and r.get("t") == "v"}
    shapes = {int(i[0]): list(i[1]) for i in sig["inputs"]}

    def run():
        values: dict = {}

        def dec(v):
            if isinstance(v, list):
                return [dec(x) for x in v]
            if not isinstance(v, dict):
                return v
            t = v.get("t")
            if t == "g":
                return grad
            if t == "s":
                return hidden[v["k"]]
            if t == "v":
                return values[(v["i"], v["j"])]
            if "dtype" in v:
                return getattr(torch, v["dtype"])
            if "device" in v:
                return torch.device("cpu")
            return getattr(torch, next(iter(v.values())))  # a memory format or a layout

        for i, (op, args, kwargs) in enumerate(calls):
            _store(values, i, op(*dec(args), **{k: dec(x) for k, x in kwargs.items()}))
            for key in [k for k in values if last.get(k, k[0]) <= i and k not in keep]:
                del values[key]
        outs = [dec(r) if r else None for r in formula["out"]]
        values.clear()  # the node returned: the engine sums a gradient to its input's shape (sum_to)
        return [o.sum_to_size(shapes[i]) if o is not None and i in shapes else o for i, o in enumerate(outs)]

    run.direct = True  # type: ignore[attr-defined]
    return run
