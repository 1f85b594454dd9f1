"""The one pass that touches live autograd objects: roots to a metadata-only ``networkx.DiGraph``.

Node ids are ``"n0", "n1", ...`` in depth-first discovery order from the roots (input 0 first), so the
same program always gives the same ids. Edges point in data-flow direction: ``u -> v`` means ``v``
consumed ``u``'s output; ``index`` is the position of ``u`` in ``v.next_functions`` (the input index),
``output`` the output of ``u`` that was consumed, ``count`` how many inputs of ``v`` it feeds.
"""

from __future__ import annotations

from collections.abc import Mapping

import networkx as nx
import torch

from ._release import keep_until_dead
from .errors import InputTypeError, NoGradRootError
from .saved import StorageIds, node_type, read_saved

__all__ = ["build_graph", "flatten_roots", "param_names"]

_DEEP = 10_000  # see NOTE [freeing deep graphs] in _release.py


def flatten_roots(root) -> list[torch.Tensor]:
    """Accept a tensor or (nested) lists/tuples of tensors; anything else is an :class:`InputTypeError`."""
    if isinstance(root, torch.Tensor):
        return [root]
    if not isinstance(root, (list, tuple)):
        raise InputTypeError(
            f"inspect() needs a tensor (the loss) or a list/tuple of tensors, got {_describe(root)}. "
            "Pass the tensor you would call .backward() on.")
    out: list[torch.Tensor] = []
    stack = [iter(root)]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            stack.append(iter(item))
        else:
            raise InputTypeError(
                f"inspect() got a list of roots holding {_describe(item)}; every root must be a tensor.")
    if not out:
        raise InputTypeError("inspect() got an empty list of roots; pass at least one tensor.")
    return out


_END = object()


def _describe(v) -> str:
    try:
        text = repr(v)
    except Exception:  # noqa: BLE001 - a user object whose __repr__ raises
        text = "<unprintable>"
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(v).__name__} {text}" if not isinstance(v, (str, type(None))) else text


def param_names(model=None, params=None) -> dict[int, tuple[str, torch.Tensor]]:
    """Map ``id(tensor) -> (qualified name, tensor)`` from a module and/or a name->tensor mapping."""
    out: dict[int, tuple[str, torch.Tensor]] = {}
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise InputTypeError(f"model= must be a torch.nn.Module, got {_describe(model)}.")
        inner = model.module if isinstance(model, (torch.nn.parallel.DistributedDataParallel,
                                                  torch.nn.DataParallel)) else model
        for name, p in inner.named_parameters():
            out.setdefault(id(p), (name, p))
    if params is not None:
        if not isinstance(params, Mapping):
            raise InputTypeError(
                f"params= must be a mapping of names to tensors (e.g. dict(model.named_parameters())), "
                f"got {_describe(params)}.")
        for name, p in params.items():
            if not isinstance(p, torch.Tensor):
                raise InputTypeError(f"params[{name!r}] must be a tensor, got {_describe(p)}.")
            out.setdefault(id(p), (str(name), p))
    return out


def _leaf_meta(t: torch.Tensor) -> dict:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
            "requires_grad": bool(t.requires_grad), "device": str(t.device)}


def _root_node(t: torch.Tensor, index: int):
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return torch.autograd.graph.get_gradient_edge(t).node
    raise NoGradRootError(
        f"root {index} (a tensor of shape {tuple(t.shape)}) has no grad_fn and does not require grad, so "
        "backward() has nothing to do: it was computed under torch.no_grad()/inference_mode, detached, "
        "or from inputs that do not require grad. Inspect the loss before any .detach()/.item().")


def build_graph(roots: list[torch.Tensor], names: dict[int, tuple[str, torch.Tensor]]) -> nx.DiGraph:
    """Walk from ``roots`` and return the metadata graph (see the module docstring)."""
    g = nx.DiGraph()
    storages = StorageIds()
    ids: dict = {}                  # live node -> id; dropped (or handed to _release) before returning
    stack: list = []
    root_info = []
    no_grad_roots = []
    for i, t in enumerate(roots):
        try:
            node = _root_node(t, i)
        except NoGradRootError:
            if len(roots) == 1:
                raise
            no_grad_roots.append(i)
            continue
        root_info.append((i, node, list(t.shape)))
    if not root_info:
        raise NoGradRootError(
            f"none of the {len(roots)} roots has a grad_fn or requires grad: there is no graph to inspect.")
    for _, node, _ in reversed(root_info):
        stack.append(node)
    order = []
    edges = []  # (child node, consumer id, input index, output nr); ids resolved after the walk
    while stack:
        node = stack.pop()
        if node in ids:
            continue
        nid = ids[node] = f"n{len(order)}"
        order.append(node)
        nexts = node.next_functions
        for child, _ in reversed(nexts):
            if child is not None and child not in ids:
                stack.append(child)
        g.add_node(nid, **_node_attrs(node, names, storages))
        for index, (child, out_nr) in enumerate(nexts):
            if child is not None:
                edges.append((child, nid, index, out_nr))
    for child, nid, index, out_nr in edges:
        _add_edge(g, ids[child], nid, index, out_nr)
    del edges
    roots_ids = []
    for i, node, shape in root_info:
        rid = ids[node]
        g.nodes[rid]["root"] = True
        g.nodes[rid].setdefault("root_shapes", []).append(shape)
        roots_ids.append(rid)
    g.graph.update({
        "roots": roots_ids,
        "root_shapes": [shape for _, _, shape in root_info],
        "no_grad_roots": no_grad_roots,
        "storage_bytes": list(storages.sizes),
        "params": _params_info(g, names, storages),
    })
    if len(order) >= _DEEP:
        keep_until_dead([t for i, t in enumerate(roots) if i not in no_grad_roots], order)
    return g


def _params_info(g: nx.DiGraph, names, storages: StorageIds) -> dict:
    where = {d["name"]: n for n, d in g.nodes(data=True) if d["kind"] == "param"}
    out = {}
    for name, p in names.values():
        try:
            sid = storages.ids.get(p.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            sid = None
        out[name] = {"requires_grad": bool(p.requires_grad), "shape": list(p.shape),
                     "dtype": str(p.dtype).removeprefix("torch."), "node": where.get(name), "storage": sid}
    return out


def _add_edge(g: nx.DiGraph, u: str, v: str, index: int, out_nr: int) -> None:
    if g.has_edge(u, v):
        g.edges[u, v]["count"] += 1
    else:
        g.add_edge(u, v, index=index, output=out_nr, count=1)


def _node_attrs(node, names, storages: StorageIds) -> dict:
    info = node_type(node)
    if info.leaf:
        var = node.variable
        named = names.get(id(var))
        attrs = {"kind": "param" if named else "input", "name": named[0] if named else "input",
                 "saved": [], "saved_bytes": 0, "module": _owner(named[0]) if named else None,
                 "root": False, "opaque": False, "seq": None}
        attrs.update(_leaf_meta(var))
        return attrs
    saved, values = read_saved(node, info, storages)
    seen_storage = set()
    held = 0
    for e in saved:
        sid = e["storage"]
        if e["status"] in ("live", "stale", "hooked") and not e.get("scalar") and sid not in seen_storage:
            if sid is not None:
                seen_storage.add(sid)
            held += e["nbytes"]
    try:
        meta = node._input_metadata
        device = str(meta[0].device) if meta else None
        out_shapes = [list(m.shape) for m in meta]
    except (AttributeError, RuntimeError, IndexError):
        device, out_shapes = None, []
    attrs = {"kind": "op", "name": info.name, "saved": saved, "saved_bytes": held, "device": device,
             "module": None, "root": False, "opaque": info.opaque, "seq": node._sequence_nr(),
             "attrs": values, "out_shapes": out_shapes}
    if info.function is not None:
        attrs["function"] = info.function
    return attrs


def _owner(qualname: str) -> str | None:
    head, _, _ = qualname.rpartition(".")
    return head or None
