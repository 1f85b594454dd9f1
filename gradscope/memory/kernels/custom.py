"""Calling a custom ``autograd.Function``'s backward again, outside its graph (NOTE [in-node memory]).

A custom Function's ``backward(ctx, *grads)`` is user code: it is called with a ``ctx`` holding fresh saved
tensors and the recorded attributes, on real random tensors (``run_custom=True``: ``rebuild.prepare``) or
on fake ones (``fake.py``, the default).
"""

from __future__ import annotations

import importlib
import re
import sys
import types
from typing import Any

import torch

from gradscope.memory.kernels.tensors import Unmeasurable, make_tensor, torch_dtype

__all__ = ["custom_call", "custom_run", "function_class"]


def function_class(sig: dict):
    """The custom Function class a signature names (raises Unmeasurable when it cannot be found)."""
    mod_name, _, qual = sig["function"].rpartition(".")
    try:
        cls: Any = sys.modules.get(mod_name) or importlib.import_module(mod_name)
    except ImportError:
        cls = None
    for part in qual.split("."):
        cls = getattr(cls, part, None)
    if cls is None or not hasattr(cls, "backward"):
        raise Unmeasurable(f"the custom Function {sig['function']} cannot be found")
    return cls


def custom_call(sig: dict) -> tuple[Any, list, Any]:
    """``(ctx, grads, materialize)`` for calling a custom Function's ``backward(ctx, *materialize())``: a
    ``ctx`` holding fresh saved tensors, the recorded attributes and ``needs_input_grad``, the gradients it
    receives in their recorded layout (None for an output nothing consumed), made in the current mode (real
    tensors, or fake ones inside a FakeTensorMode); ``materialize()`` returns them with zeros of the
    output's shape for the missing ones, as torch makes them inside the node (``materialize_grads``, the
    default: whether a forward turned it off is not readable), to be called inside the measured window."""
    saved = sorted((s for s in sig["saved"] if s[0].startswith("saved_tensors[")), key=lambda s: int(s[0][14:-1]))
    ctx = types.SimpleNamespace()
    for k, v in sig["attrs"].items():
        m = re.fullmatch(r"Tensor\[(.*)\]", v) if isinstance(v, str) else None
        setattr(ctx, k, make_tensor(eval_shape(m.group(1)), "float32") if m else v)
    ctx.saved_tensors = tuple(make_tensor(s[1], s[3], s[2]) for s in saved)
    ctx.saved_variables = ctx.saved_tensors
    n_in = max([i[0] for i in sig["inputs"]] + [0]) + 1
    ctx.needs_input_grad = tuple(any(i[0] == p for i in sig["inputs"]) for p in range(n_in))
    ctx.materialize_grads = True
    got = _grads(sig)
    grads = [got.get(k) for k in range(sig.get("n_out") or 1)]
    outs = sig.get("outs") or []

    def materialize() -> list:
        out = []
        for k, g in enumerate(grads):
            if g is None:
                shape, dtype = outs[k] if k < len(outs) and outs[k][0] is not None else ([0], "float32")
                g = torch.zeros([int(n) for n in shape], dtype=torch_dtype(dtype))
            out.append(g)
        return out

    return ctx, grads, materialize


def custom_run(sig: dict):
    """A callable running the custom Function's backward once on fresh real tensors (``rebuild.prepare``)."""
    cls = function_class(sig)
    ctx, g, materialize = custom_call(sig)

    def run():
        with torch.no_grad():
            return cls.backward(ctx, *materialize())

    run.grads = g  # type: ignore[attr-defined]
    run.direct = True  # type: ignore[attr-defined]  # no engine node: the whole marker is the backward
    return run


def eval_shape(text: str) -> list:
    return [int(x) for x in text.split(",") if x.strip()]


def _grads(sig: dict) -> dict:
    return {g[0]: make_tensor(g[1], g[3], g[2]) for g in sig["grads"]}
