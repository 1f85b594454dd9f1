"""The model's parameter names and buffers, as ``inspect()`` needs them, read once per model structure.

NOTE [model structure cache]
Every ``inspect(..., model=m)`` needs ``id(tensor) -> (qualified name, tensor)`` for the parameters and the
list of buffers. Walking the modules for them costs 1.5-3 us per module (0.7 ms on GPT-2 small), as much as
the whole graph walk of a small model. So the last model's structure is kept: the modules in traversal
order (weak references: modules only), per module the keys of ``_parameters``, ``_buffers`` and
``_modules`` and the ids and types of their values, and what the two traversals selected (the names, the
positions). A call reuses it only when, read afresh in a few C-level passes, every module is alive with
the same class, every class still uses ``nn.Module``'s own ``named_parameters`` / ``buffers`` machinery,
and the three dicts of every module hold the same keys and values of the same ids and types; the values
handed out are always the ones read now. A parameter added, replaced, deleted or set to None, a buffer
registered, a submodule swapped, a class that overrides those methods: each rebuilds it. An id reused by a
new object at the same place (the old one freed) gives the same answer as a fresh walk: names come from
the keys, tensors from the dicts now, and equal ids mean the same sharing. Nothing else is cached:
``requires_grad``, ``.grad``, shapes and storages are read on every call. No tensor is referenced at all,
not even weakly (a weak reference would make ``torch.utils.swap_tensors`` refuse it, which
``module.to()`` uses under ``torch.__future__.set_swap_module_params_on_conversion``), and no module is kept
alive (tests/walk/test_named.py checks all of this against torch).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from itertools import accumulate, chain
from operator import attrgetter, itemgetter

import torch

from gradscope._format import one_line
from gradscope._torch import fsdp2_groups
from gradscope._wrappers import is_fsdp2, unwrap
from gradscope.errors import InputTypeError, InputValueError

__all__ = ["param_names", "model_buffers", "names_and_buffers"]

_MODULE = torch.nn.Module
_PARAM_METHODS = ("named_parameters", "named_modules", "_named_members")
_BUFFER_METHODS = ("buffers", "named_buffers", "named_modules", "_named_members")
_METHODS = tuple(dict.fromkeys(_PARAM_METHODS + _BUFFER_METHODS))
_CALL = weakref.ref.__call__
_values = dict.values


def describe(v) -> str:
    """``"int 3"``, ``"'text'"``: a value for an error message."""
    text = one_line(v)
    return f"{type(v).__name__} {text}" if not isinstance(v, (str, type(None))) else text


def names_and_buffers(model=None, params=None) -> tuple[dict[int, tuple[str, torch.Tensor]], list]:
    """``(param_names(model, params), model_buffers(model))`` with one look at the model's structure."""
    if model is None:
        return param_names(None, params), []
    if not isinstance(model, _MODULE):
        raise InputTypeError(f"model= must be a torch.nn.Module, got {describe(model)}.")
    inner = unwrap(model)
    hit = _cached(inner)
    if hit is None:
        names, buffers = _named(inner), _buffers(inner)
    else:
        entry, values = hit
        names, buffers = entry.names(values), list(entry.pick_buffers(values))
    if is_fsdp2(inner):
        fs = fsdp2_names(inner)  # last: the sharded parameter describes each name (see fsdp2_names)
        names = {k: v for k, v in names.items() if k not in fs} | fs
    return _add_params(names, params), buffers


def fsdp2_names(model) -> dict[int, tuple[str, torch.Tensor]]:
    """An FSDP2 model's parameters by the id of the unsharded parameter its forward ran on (what the graph's
    AccumulateGrad and saved tensors hold: the parameter's storage), then of the sharded one, which describes
    the name (``_params_info`` in build.py: the later entry wins; the id an optimizer holds, the shape the
    whole parameter's). The graph then has the unsharded model's parameters (NOTE [FSDP2] in watching/fsdp.py)."""
    where = {id(m): n for n, m in model.named_modules()}
    out: dict[int, tuple[str, torch.Tensor]] = {}
    later: list = []
    for m in model.modules():
        if not is_fsdp2(m):
            continue
        for _, params in fsdp2_groups(m):
            for module, attr, sharded, unsharded in params:
                prefix = where.get(id(module), "")
                name = f"{prefix}.{attr}" if prefix else attr
                if unsharded is not None:
                    out[id(unsharded)] = (name, unsharded)
                later.append((id(sharded), (name, sharded)))
    return out | dict(later)


def param_names(model=None, params=None) -> dict[int, tuple[str, torch.Tensor]]:
    """Map ``id(tensor) -> (qualified name, tensor)`` from a module and/or a name->tensor mapping."""
    if model is None:
        return _add_params({}, params)
    return names_and_buffers(model, params)[0]


def model_buffers(model) -> list:
    """The model's buffers (BatchNorm statistics...), for the memory budget; [] without a model.

    ``list(model.buffers())`` without its nested generators (as :func:`_plain_named_parameters`) unless a
    module on the way overrides the methods it relies on; duplicates are left in (``_buffers_info``
    counts each storage once).
    """
    if not isinstance(model, _MODULE):
        return []
    return names_and_buffers(model)[1]


def _add_params(out: dict, params) -> dict:
    if params is None:
        return out
    if not isinstance(params, Mapping):
        raise InputTypeError(
            f"params= must be a mapping of names to tensors (e.g. dict(model.named_parameters())), "
            f"got {describe(params)}."
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
            raise InputTypeError(f"params[{text!r}] must be a tensor, got {describe(p)}.")
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


# -- without the cache ---------------------------------------------------------------------------------
def _named(inner) -> dict:
    out: dict = {}
    named = _plain_named_parameters(inner)
    for item in inner.named_parameters() if named is None else named:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise InputTypeError(
                f"model.named_parameters() of {type(inner).__name__} must yield (name, tensor) pairs, "
                f"it yielded {describe(item)}; pass params=dict(...) instead."
            )
        out.setdefault(id(item[1]), (str(item[0]), item[1]))
    return out


def _plain(cls) -> bool:
    return _GET_METHODS(cls) == _BASE_METHODS


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
        if any(getattr(cls, a) is not getattr(_MODULE, a) for a in _PARAM_METHODS):
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


def _buffers(inner) -> list:
    out: list = []
    for m in _buffer_order(inner):
        cls = type(m)
        if any(getattr(cls, a) is not getattr(_MODULE, a) for a in _BUFFER_METHODS):
            try:
                return list(inner.buffers())
            except Exception:  # noqa: BLE001 - a module whose buffers() is overridden and raises
                return []
        out.extend(b for b in m._buffers.values() if b is not None)
    return out


def _buffer_order(inner):
    """The modules in ``model_buffers``' order (children pushed unreversed), each once."""
    memo: set = set()
    stack = [inner]
    while stack:
        m = stack.pop()
        if m in memo:
            continue
        memo.add(m)
        yield m
        stack.extend(sub for sub in m._modules.values() if sub is not None)


# -- the cache: NOTE [model structure cache] -----------------------------------------------------------
_THREE = attrgetter("_parameters", "_buffers", "_modules")
_GET_METHODS = attrgetter(*_METHODS)
_BASE_METHODS = _GET_METHODS(_MODULE)


def _read(mods: list) -> tuple[tuple, list]:
    """What the outputs depend on, in a few C-level passes over the modules' three dicts (parameters,
    buffers, submodules, in that order per module): the dicts' lengths (which place each key in its dict),
    their keys, the ids and types of their values; and the flat list of the values themselves."""
    dicts = list(chain.from_iterable(map(_THREE, mods)))
    values = list(chain.from_iterable(map(_values, dicts)))
    sig = (tuple(map(len, dicts)), tuple(chain.from_iterable(dicts)), tuple(map(id, values)), tuple(map(type, values)))
    return sig, values


def _picker(positions: list[int]):
    """``values -> tuple(values[p] for p in positions)`` in one C call."""
    if not positions:
        return lambda values: ()
    if len(positions) == 1:
        p = positions[0]
        return lambda values: (values[p],)
    return itemgetter(*positions)


class _Structure:
    """One model's structure and what the two traversals selected from it (see the NOTE)."""

    __slots__ = (
        "inner",
        "mod_refs",
        "types",
        "classes",
        "sig",
        "pids",
        "pnames",
        "pick_params",
        "pick_buffers",
    )

    def __init__(self, inner, mods: list, prefixes: list[str]) -> None:
        self.inner = weakref.ref(inner)
        self.mod_refs = [weakref.ref(m) for m in mods]
        self.types = tuple(map(type, mods))
        self.classes = tuple(set(self.types))
        self.sig, values = _read(mods)
        lens = self.sig[0]
        starts = list(accumulate(lens, initial=0))  # dict d's values start at starts[d]; d = 3 * module + kind
        index = {id(m): j for j, m in enumerate(mods)}
        # parameters: pre-order, each module once, the first name of a shared tensor (_plain_named_parameters)
        psel: list[int] = []
        self.pids: list[int] = []
        self.pnames: list[str] = []
        taken: set = set()
        for j, (m, prefix) in enumerate(zip(mods, prefixes)):
            dot = prefix + "." if prefix else ""
            for pos, (k, v) in enumerate(m._parameters.items(), starts[3 * j]):
                if v is not None and id(v) not in taken:
                    if type(k) is not str or not isinstance(v, torch.Tensor):
                        raise TypeError("not a plain module")  # the uncached code says what is wrong
                    taken.add(id(v))
                    psel.append(pos)
                    self.pids.append(id(v))
                    self.pnames.append(dot + k)
        self.pick_params = _picker(psel)
        # buffers: model_buffers' own order (children pushed unreversed), duplicates kept
        bsel: list[int] = []
        for m in _buffer_order(inner):
            start = starts[3 * index[id(m)] + 1]
            bsel.extend(pos for pos, b in enumerate(m._buffers.values(), start) if b is not None)
        self.pick_buffers = _picker(bsel)

    def names(self, values: list) -> dict:
        return dict(zip(self.pids, zip(self.pnames, self.pick_params(values))))

    def valid(self, inner) -> list | None:
        """The modules' dict values read afresh when the structure is unchanged, else None."""
        if self.inner() is not inner:
            return None
        mods = list(map(_CALL, self.mod_refs))  # a freed module reads None: its type is NoneType
        if tuple(map(type, mods)) != self.types or not all(map(_BASE_METHODS.__eq__, map(_GET_METHODS, self.classes))):
            return None
        sig, values = _read(mods)
        return values if sig == self.sig else None


_LAST: list = [None]  # the last model's _Structure (one entry: the model a training loop inspects)


def _cached(inner):
    """``(structure, the modules' dict values)`` of ``inner``, or None where it cannot be cached."""
    entry = _LAST[0]
    try:
        if entry is not None:
            got = entry.valid(inner)
            if got is not None:
                return entry, got
        _LAST[0] = None
        mods, prefixes = _modules(inner)
        if mods is None:
            return None
        entry = _Structure(inner, mods, prefixes)
        got = entry.valid(inner)
    except Exception:  # noqa: BLE001 - anything unusual (a _parameters that is no dict...): no cache
        return None
    if got is None:  # a class that is not plain after all
        return None
    _LAST[0] = entry
    return entry, got


def _modules(inner) -> tuple[list | None, list[str]]:
    """The modules in ``_plain_named_parameters``' order and their prefixes; None if a class is not plain."""
    mods, prefixes = [], []
    memo: set = set()
    stack = [("", inner)]
    while stack:
        prefix, m = stack.pop()
        if m in memo:
            continue
        if not _plain(type(m)):
            return None, []
        memo.add(m)
        mods.append(m)
        prefixes.append(prefix)
        dot = prefix + "." if prefix else ""
        subs = [(dot + k, sub) for k, sub in m._modules.items() if sub is not None]
        subs.reverse()
        stack.extend(subs)
    return mods, prefixes
