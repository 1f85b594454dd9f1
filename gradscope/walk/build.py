"""The one pass that touches live autograd objects: roots to metadata-only compact records, from which
the ``networkx.DiGraph`` of the contract is built on demand (NOTE [compact records] in ``records.py``).

Node ids are ``"n0", "n1", ...`` in depth-first discovery order from the roots (input 0 first), so the
same program always gives the same ids. Edges point in data-flow direction: ``u -> v`` means ``v``
consumed ``u``'s output; ``index`` is the position of ``u`` in ``v.next_functions`` (the input index),
``output`` the output of ``u`` that was consumed, ``count`` how many inputs of ``v`` it feeds.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping

import networkx as nx
import torch

from gradscope._format import one_line
from gradscope.errors import InputTypeError, InputValueError, NoGradRootError
from gradscope.walk.holders import external
from gradscope.walk.loop import walk
from gradscope.walk.records import Records, node_id
from gradscope.walk.release import keep_until_dead
from gradscope.walk.saved import _DTYPES, StorageIds, dtype_str

__all__ = ["build", "build_graph", "flatten_roots", "param_names", "model_buffers"]

_DEEP = 10_000  # from this many nodes on, release the walk's wrappers safely: NOTE [freeing deep graphs]


def flatten_roots(root) -> list[torch.Tensor]:
    """Accept a tensor or (nested) lists/tuples of tensors; anything else is an :class:`InputTypeError`."""
    if isinstance(root, torch.Tensor):
        return [root]
    if not isinstance(root, (list, tuple)):
        raise InputTypeError(
            f"inspect() needs a tensor (the loss) or a list/tuple of tensors, got {_describe(root)}. "
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
                f"inspect() got a list of roots holding {_describe(item)}; every root must be a tensor."
            )
    if not out:
        raise InputTypeError("inspect() got an empty list of roots; pass at least one tensor.")
    return out


_END = object()


def _describe(v) -> str:
    text = one_line(v)
    return f"{type(v).__name__} {text}" if not isinstance(v, (str, type(None))) else text


def param_names(model=None, params=None) -> dict[int, tuple[str, torch.Tensor]]:
    """Map ``id(tensor) -> (qualified name, tensor)`` from a module and/or a name->tensor mapping."""
    out: dict[int, tuple[str, torch.Tensor]] = {}
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise InputTypeError(f"model= must be a torch.nn.Module, got {_describe(model)}.")
        inner = (
            model.module
            if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel))
            else model
        )
        named = _plain_named_parameters(inner)
        for item in inner.named_parameters() if named is None else named:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
                raise InputTypeError(
                    f"model.named_parameters() of {type(inner).__name__} must yield (name, tensor) pairs, "
                    f"it yielded {_describe(item)}; pass params=dict(...) instead."
                )
            out.setdefault(id(item[1]), (str(item[0]), item[1]))
    if params is not None:
        if not isinstance(params, Mapping):
            raise InputTypeError(
                f"params= must be a mapping of names to tensors (e.g. dict(model.named_parameters())), "
                f"got {_describe(params)}."
            )
        for name, p in params.items():
            try:
                text = name if isinstance(name, str) else str(name)
            except Exception:  # noqa: BLE001 - a key whose __str__/__repr__ raises
                raise InputTypeError(
                    f"params= keys must be parameter names (str); got a {type(name).__name__} key that "
                    "cannot be turned into a string. Use dict(model.named_parameters())."
                ) from None
            if not isinstance(p, torch.Tensor):
                raise InputTypeError(f"params[{text!r}] must be a tensor, got {_describe(p)}.")
            if p.grad_fn is not None:
                # A non-leaf never has an AccumulateGrad node: the walk could not tell whether it is
                # reached, and it would be reported unused although retain_grad() fills its .grad.
                raise InputValueError(
                    f"params[{text!r}] is not a leaf tensor (it was computed by {p.grad_fn.name()}): "
                    "params= names the leaves a gradient accumulates into (parameters, inputs that "
                    "require grad). Pass the leaves it was computed from, or check its .grad after "
                    "backward() if you called retain_grad() on it."
                )
            out.setdefault(id(p), (text, p))
    return out


_MODULE = torch.nn.Module


def _plain_named_parameters(module) -> list | None:
    """``list(module.named_parameters())`` without its nested generators, or None when any module on the
    way overrides the methods it relies on (then the caller uses ``named_parameters()`` itself).

    Same order (pre-order over ``_modules``, each module once) and the same names; a parameter shared
    under several names comes once per name here, and ``param_names`` keeps the first, like torch.
    """
    out = []
    memo = set()
    stack = [("", module)]
    while stack:
        prefix, m = stack.pop()
        if m in memo:
            continue
        cls = type(m)
        if (
            cls.named_parameters is not _MODULE.named_parameters
            or cls.named_modules is not _MODULE.named_modules
            or cls._named_members is not _MODULE._named_members
        ):
            return None
        memo.add(m)
        dot = prefix + "." if prefix else ""
        for k, v in m._parameters.items():
            if v is not None:
                out.append((dot + k, v))
        subs = [(dot + k, sub) for k, sub in m._modules.items() if sub is not None]
        subs.reverse()
        stack.extend(subs)
    return out


def model_buffers(model) -> list:
    """The model's buffers (BatchNorm statistics...), for the memory budget; [] without a model.

    ``list(model.buffers())`` without its nested generators (as :func:`_plain_named_parameters`) unless a
    module on the way overrides the methods it relies on; duplicates are left in (``_buffers_info``
    counts each storage once).
    """
    if not isinstance(model, _MODULE):
        return []
    inner = (
        model.module if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)) else model
    )
    out: list = []
    memo: set = set()
    stack = [inner]
    while stack:
        m = stack.pop()
        if m in memo:
            continue
        cls = type(m)
        if (
            cls.buffers is not _MODULE.buffers
            or cls.named_buffers is not _MODULE.named_buffers
            or cls.named_modules is not _MODULE.named_modules
            or cls._named_members is not _MODULE._named_members
        ):
            try:
                return list(inner.buffers())
            except Exception:  # noqa: BLE001 - a module whose buffers() is overridden and raises
                return []
        memo.add(m)
        out.extend(b for b in m._buffers.values() if b is not None)
        stack.extend(sub for sub in m._modules.values() if sub is not None)
    return out


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
    roots: list[torch.Tensor], names: dict[int, tuple[str, torch.Tensor]], buffers=(), fast: bool = True
) -> Records:
    """Walk from ``roots`` into compact :class:`~gradscope.walk.records.Records` (NOTE [compact records]).

    ``records.digraph()`` is :func:`build_graph`'s DiGraph; ``buffers``: the model's buffers (for the
    memory budget: ``graph["buffers"]``); ``fast=False`` reads every node with the general saved-slot
    reader (for tests).
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
        storages = StorageIds()
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
            }
        )
        if len(ids) >= _DEEP:
            keep_until_dead([t for i, t in enumerate(roots) if i not in no_grad_roots], list(ids))
        del ids
    finally:
        if gc_was_enabled:
            gc.enable()
    return records


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
    out = {}
    ids_get = storages.ids.get
    for name, p in names.values():
        try:
            sid = ids_get(p.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            sid = None
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
