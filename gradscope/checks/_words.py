"""User words for the in-place findings: which tensor (a parameter, the output of a module's op), which fix.

Autograd's slot names (``self``, ``mat2``, ``saved_tensors[0]``) mean nothing to a user; a saved tensor is
named by what it is: a parameter (its storage is the parameter's), the node's own output, or the output
of the op (and module) that produced it, found among the node's inputs by shape, or as another node's
saved output of the same storage.
"""

from __future__ import annotations

import re

from gradscope.graph import PARAMS

__all__ = ["tensor_words", "fix_words", "op_words"]

_BACKWARD = re.compile(r"Backward\d*$")
# In-place ops whose out-of-place twin does not exist (x.zero() is an AttributeError), with what to write.
_NO_TWIN = {
    "zero_": "torch.zeros_like(x)",
    "fill_": "torch.full_like(x, value)",
    "copy_": "a new tensor (y = src.clone()) instead of copying into x",
    "uniform_": "torch.rand_like(x) (scaled)",
    "normal_": "torch.randn_like(x) (scaled)",
    "bernoulli_": "torch.bernoulli(torch.full_like(x, p))",
    "random_": "torch.randint_like(x, high)",
    "exponential_": "a new tensor from torch.empty_like(x).exponential_() made before x is used",
    "set_": "a new tensor",
    "resize_": "x.reshape(...) or a new tensor",
    "__setitem__": "torch.where(mask, value, x), or x.index_put((idx,), value)",
}


def op_words(name: str) -> str:
    """``SigmoidBackward0 -> 'Sigmoid'``; custom Functions keep their class name."""
    return _BACKWARD.sub("", name) or name


def _module(d) -> str:
    return f" in {d['module']}" if d.get("module") else ""


def tensor_words(graph, nid: str, entry: dict) -> str:
    """The saved tensor ``entry`` of node ``nid`` in the user's words (no autograd slot names)."""
    d = graph.nodes[nid]
    slot = entry["slot"]
    if slot.startswith("checkpoint input"):
        return "an input of its checkpoint region (kept to recompute the region)"
    if slot.startswith("hidden["):  # NOTE [CopySlices formula]: the in-place op inside the node saved it
        op = entry.get("hidden_op")
        return "a tensor for the in-place op it wraps" + (f" ({op_words(op)})" if op else "")
    if slot == "result" or slot.startswith("result"):
        return "its own output" if slot == "result" else "one of its own outputs"
    sid = entry.get("storage")
    if sid is not None:
        for name, p in graph.graph.get(PARAMS, {}).items():
            if p.get("storage") == sid:
                return f"the parameter {name}"
        for other, od in graph.nodes(data=True):
            if other != nid and any(
                e.get("storage") == sid and str(e["slot"]).startswith("result") for e in od.get("saved", ())
            ):
                return f"the output of {op_words(od['name'])}{_module(od)} ({other})"
    shape = list(entry.get("shape") or [])
    fits = []
    for u in graph.predecessors(nid):
        ud = graph.nodes[u]
        out = graph.edges[u, nid].get("output", 0)
        shapes = ud.get("out_shapes") or ([ud.get("shape")] if ud["kind"] != "op" else [])
        if out < len(shapes) and list(shapes[out] or []) == shape:
            fits.append((u, ud))
    if len(fits) == 1:
        u, ud = fits[0]
        if ud["kind"] == "param":
            return f"the parameter {ud['name']}"
        if ud["kind"] == "input":
            return "an input tensor of the graph"
        return f"the output of {op_words(ud['name'])}{_module(ud)} ({u})"
    return "a tensor it saved as an input" if not d.get("function") else "a tensor it saved for backward"


def fix_words(op: str, optimizer: bool = False) -> str:
    """The change to make at the write (starts lower-case, no final period)."""
    if optimizer:
        return (
            "call backward() before optimizer.step() (the step writes the parameters in place), or do "
            "not step between this forward and its backward"
        )
    if "inplace=True" in op:
        return f"pass inplace=False to {op.split('(')[0]}()"
    if "max_norm" in op:
        return (
            "renormalize outside the graph: F.embedding(..., max_norm=...) rescales the weight rows in "
            "place, so call it before any other use of the weight, or drop max_norm"
        )
    if op in _NO_TWIN:
        return f"write {_NO_TWIN[op]} instead of {op}()"
    if op.startswith("__i") and op.endswith("__"):
        sym = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "matmul": "@", "pow": "**"}.get(op[3:-2])
        return f"write x = x {sym} y instead of x {sym}= y" if sym else "use the out-of-place operator"
    if op.endswith("_") and not op.endswith("__"):
        import torch

        if hasattr(torch.Tensor, op[:-1]):
            return f"use the out-of-place {op[:-1]}() instead of {op}()"
        return f"compute a new tensor instead of {op}()"
    return "use the out-of-place op (x = x.mul(2) instead of x.mul_(2); inplace=False on the module)"
