"""The one pass that touches live autograd objects: roots to metadata-only compact records, from which
the ``networkx.DiGraph`` of the contract is built on demand (NOTE [compact records] in ``records.py``).

Node ids are ``"n0", "n1", ...`` in depth-first discovery order from the roots (input 0 first), so the
same program always gives the same ids. Edges point in data-flow direction: ``u -> v`` means ``v``
consumed ``u``'s output; ``index`` is the position of ``u`` in ``v.next_functions`` (the input index),
``output`` the output of ``u`` that was consumed, ``count`` how many inputs of ``v`` it feeds.
"""

from __future__ import annotations

import gc

import networkx as nx
import torch

from gradscope.errors import InputTypeError, InputValueError, NoGradRootError
from gradscope.walk.holders import external
from gradscope.walk.loop import walk
from gradscope.walk.named import describe, model_buffers, param_names
from gradscope.walk.records import Records, node_id
from gradscope.walk.release import keep_until_dead
from gradscope.walk.slots import StorageIds
from gradscope.walk.values import DTYPES as _DTYPES
from gradscope.walk.values import dtype_str

__all__ = ["build", "build_graph", "flatten_roots", "param_names", "model_buffers"]

_DEEP = 10_000  # from this many nodes on, release the walk's wrappers safely: NOTE [freeing deep graphs]


def flatten_roots(root) -> list[torch.Tensor]:
    """Accept a tensor or (nested) lists/tuples of tensors; anything else is an :class:`InputTypeError`."""
    if isinstance(root, torch.Tensor):
        return [root]
    if not isinstance(root, (list, tuple)):
        raise InputTypeError(
            f"inspect() needs a tensor (the loss) or a list/tuple of tensors, got {describe(root)}. "
            "Pass the tensor you would call .backward() on."
        )
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
                f"inspect() got a list of roots holding {describe(item)}; every root must be a tensor."
            )
    if not out:
        raise InputTypeError("inspect() got an empty list of roots; pass at least one tensor.")
    return out


_END = object()


def _shape(t: torch.Tensor) -> list[int] | None:
    """``list(t.shape)``, or None for a nested tensor (torch gives it no shape)."""
    try:
        return list(t.shape)
    except RuntimeError:
        return None


def _shape_text(t: torch.Tensor) -> str:
    shape = _shape(t)
    return "unknown (a nested tensor)" if shape is None else str(tuple(shape))


def _root_node(t: torch.Tensor, index: int):
    try:
        grad_fn = t.grad_fn
    except RuntimeError as exc:  # e.g. a no_grad view whose base was later modified in place
        raise InputValueError(
            f"root {index} (a tensor of shape {_shape_text(t)}) cannot be differentiated: torch refuses "
            f"to read its grad_fn ({str(exc).split('. ')[0]}). backward() raises the same; see torch's "
            "message for the fix."
        ) from None
    if grad_fn is not None:
        return grad_fn
    if t.requires_grad:
        try:
            return torch.autograd.graph.get_gradient_edge(t).node
        except (AssertionError, RuntimeError):
            # A view of a leaf taken under no_grad reports requires_grad=True without a grad_fn or a
            # gradient accumulator; backward() rejects it as "does not require grad".
            raise NoGradRootError(
                f"root {index} (a tensor of shape {_shape_text(t)}) says requires_grad=True but has no "
                "grad_fn and is not a leaf torch can accumulate into: it is a view of a parameter taken "
                "under torch.no_grad(), and backward() rejects it. Take the view with grad enabled."
            ) from None
    raise NoGradRootError(
        f"root {index} (a tensor of shape {_shape_text(t)}) has no grad_fn and does not require grad, so "
        "backward() has nothing to do: it was computed under torch.no_grad()/inference_mode, detached, "
        "or from inputs that do not require grad. Inspect the loss before any .detach()/.item()."
    )


def _root_storage_bytes(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def build_graph(roots: list[torch.Tensor], names: dict[int, tuple[str, torch.Tensor]]) -> nx.DiGraph:
    """Walk from ``roots`` and return the metadata graph (see the module docstring)."""
    return build(roots, names).digraph()


def build(
    roots: list[torch.Tensor],
    names: dict[int, tuple[str, torch.Tensor]],
    buffers=(),
    fast: bool = True,
    storages: StorageIds | None = None,
) -> Records:
    """Walk from ``roots`` into compact :class:`~gradscope.walk.records.Records` (NOTE [compact records]).

    ``records.digraph()`` is :func:`build_graph`'s DiGraph; ``buffers``: the model's buffers (for the
    memory budget: ``graph["buffers"]``); ``fast=False`` reads every node with the general saved-slot
    reader (for tests); ``storages``: the walk's storage ids, to read after it (a fresh one by default).
    """
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
        root_info.append((i, node, _shape(t)))
    if not root_info:
        raise NoGradRootError(
            f"none of the {len(roots)} roots has a grad_fn or requires grad: there is no graph to inspect."
        )
    gc_was_enabled = gc.isenabled()
    gc.disable()  # generational GC passes over the walk's allocations would dominate its time
    try:
        storages = StorageIds() if storages is None else storages
        records, ids = walk([node for _, node, _ in root_info], names, storages, fast)
        roots_idx = [ids[node] for _, node, _ in root_info]
        records.roots = roots_idx
        records.graph.update(
            {
                "roots": [node_id(i) for i in roots_idx],
                "root_shapes": [shape for _, _, shape in root_info],
                "root_storage_bytes": [
                    _root_storage_bytes(roots[i]) for i, _, _ in root_info
                ],  # a scalar loss may view a big buffer
                "no_grad_roots": no_grad_roots,
                "storage_bytes": list(storages.sizes),
                "params": _params_info(records.param_nodes, names, storages),
                "external": external(storages.uses, storages.impls),  # NOTE [holder counts]
                "buffers": _buffers_info(buffers, storages),
                "input_storages": _input_storages(records.leaves, ids, storages),
            }
        )
        records.storage_ptrs = _storage_ptrs(records.leaves, ids, storages)
        if len(ids) >= _DEEP:
            keep_until_dead([t for i, t in enumerate(roots) if i not in no_grad_roots], list(ids))
        del ids
    finally:
        if gc_was_enabled:
            gc.enable()
    return records


def _input_storages(leaves: dict, ids: dict, storages: StorageIds) -> dict:
    """``{node id: storage id}`` of the input leaves (tensors that require grad, not parameters) whose
    storage an op saved too: the step's budget counts such a storage once (``memory/replay/accounting.py``)."""
    inputs = [i for i, leaf in leaves.items() if leaf[0] == "input"]
    if not inputs:
        return {}
    nodes = list(ids)  # discovery order: node i is the i-th key
    out = {}
    for i in inputs:
        try:
            sid = storages.ids.get(nodes[i].variable.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
            continue
        if sid is not None:
            out[node_id(i)] = sid
    return out


def _storage_ptrs(leaves: dict, ids: dict, storages: StorageIds) -> dict:
    """``{StorageImpl pointer: storage id}`` of every storage the walk saw, and ``-1 - i`` for input leaf
    ``i``'s: plain integers (nothing is kept alive) that let ``backward_memory(inputs=...)`` tell which of the
    caller's tensors the budget already counts (``memory/replay/accounting.py``); never saved to JSON."""
    out = dict(storages.ids)
    nodes = None
    for i, leaf in leaves.items():
        if leaf[0] != "input":
            continue
        nodes = list(ids) if nodes is None else nodes
        try:
            out.setdefault(nodes[i].variable.untyped_storage()._cdata, -1 - i)
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
            continue
    return out


def _buffers_info(buffers, storages: StorageIds) -> list:
    """``[storage id or None, bytes]`` per distinct buffer storage (the id when a node saved it too)."""
    out, seen = [], set()
    for b in buffers:
        try:
            st = b.untyped_storage()
            ptr, size = st._cdata, st.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        if ptr not in seen:
            seen.add(ptr)
            out.append([storages.ids.get(ptr), size])
    return out


def _params_info(where: dict, names, storages: StorageIds) -> dict:
    out: dict[str, dict] = {}
    ids_get = storages.ids.get
    for name, p in names.values():
        try:
            sid = ids_get(p.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            sid = None
        if sid is None and name in out and type(p).__name__ == "DTensor":  # FSDP2's sharded parameter, after
            sid = out[name]["storage"]  # its unsharded one (walk/named.py fsdp2_names): the graph saved that one
        dtype = p.dtype
        try:
            shape = list(p.shape)
        except RuntimeError:  # a nested tensor
            shape = None
        out[name] = {
            "requires_grad": bool(p.requires_grad),
            "shape": shape,
            "dtype": _DTYPES.get(dtype) or dtype_str(dtype),
            "node": where.get(name),
            "storage": sid,
            "grad": p.grad is not None,
            "pid": id(p),
        }
    return out
