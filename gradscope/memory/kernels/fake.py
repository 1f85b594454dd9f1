"""A custom ``autograd.Function``'s backward measured on fake tensors (NOTE [custom backwards on fake tensors]).

NOTE [custom backwards on fake tensors]
A custom Function's ``backward`` is user code, so its temporaries (BLOOM's GeLU recomputes ``tanh`` and
keeps several activation-sized intermediates) are known only by running it. By default gradscope runs it
on fake tensors (``_torch.fake_tensor_mode``: shapes, strides and dtypes, no data and no memory), with a
``ctx`` as ``rebuild.custom_call`` builds it (the saved tensors, the recorded attributes, the gradients it
receives in their recorded layout), under a ``TorchDispatchMode`` that sees every aten call the backward
makes: each output storage not seen before is an allocation of its ``nbytes`` (what c10's CPU allocator
is asked for), and a weak reference on the storage object (torch keeps one Python object per live storage)
says when it is freed. The highest running sum minus the storages it returns (the gradients, which the
replay counts as the node's outputs) is the node's in-node memory, as ``measure._in_node`` computes it from
profiler events for a real run. What happens below aten (a kernel's own scratch buffers: a sort's, a
BLAS's) is not seen, so only pure tensor code is answered this way; ``run_custom=True`` runs the backward
on real random tensors under torch.profiler instead.

It runs only when that is safe, decided before anything runs (:func:`unsafe_reason`): the backward's code
and the Python functions it calls (to a few levels) write no global or enclosing variable, and every
global or closure value they read is a number, a string, a dtype, a tuple of those, a torch module or
function, a ``math``-like module, an allow-listed builtin (not ``print``, ``open``, ``setattr``...), or a
Python function / custom Function that passes the same check; ``torch.distributed`` is refused. A
backward that then reads a value (``.item()``, a tensor in an ``if``), makes a value-dependent shape, uses
an op with no fake kernel or raises is not measured: its node stays a labelled lower bound, with the
reason and the hint to pass ``run_custom=True``.
"""

from __future__ import annotations

import builtins
import dis
import functools
import logging
import types
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gradscope._torch import fake_tensor_mode
from gradscope.memory.kernels.tensors import Unmeasurable

__all__ = ["measure_fake", "unsafe_reason", "FAKE", "REAL"]

#: How a custom Function's in-node memory was measured (``InNode.how``; printed per node).
FAKE = "fake tensors"
REAL = "real random tensors (run_custom=True)"

_SAFE_BUILTINS = frozenset(
    "abs all any bool complex dict divmod enumerate filter float frozenset getattr hasattr int isinstance "
    "issubclass iter len list map max min next object pow range reversed round set slice sorted str sum "
    "super tuple type zip NotImplemented Ellipsis None True False ArithmeticError AssertionError "
    "AttributeError Exception IndexError KeyError NotImplementedError RuntimeError TypeError ValueError".split()
)
_SAFE_MODULES = ("torch", "math", "operator", "functools", "itertools", "numbers", "typing", "einops", "cmath")
_REFUSED_MODULES = ("torch.distributed",)
_DEPTH = 4
_WRITES = frozenset({"STORE_GLOBAL", "DELETE_GLOBAL"})
_CLOSURE_WRITES = frozenset({"STORE_DEREF", "DELETE_DEREF"})


def _module_ok(name: str) -> bool:
    if any(name == r or name.startswith(r + ".") for r in _REFUSED_MODULES):
        return False
    return any(name == m or name.startswith(m + ".") for m in _SAFE_MODULES)


def _value_reason(name: str, v: Any, depth: int, seen: set) -> str | None:
    """Why reading ``v`` (the global or closure variable ``name``) may not be safe, or None."""
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes, type(Ellipsis), slice)):
        return None
    if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)):
        return None
    if isinstance(v, (tuple, frozenset)):
        return next((r for x in v if (r := _value_reason(name, x, depth, seen))), None)
    if isinstance(v, types.ModuleType):
        return None if _module_ok(v.__name__) else f"it uses the module {v.__name__}"
    if isinstance(v, torch.Tensor):
        return f"it reads the tensor {name!r} from outside the Function"
    if v is getattr(builtins, name, None) and (
        isinstance(v, types.BuiltinFunctionType) or isinstance(v, type)
    ):  # a builtin read by its own name
        return None if name in _SAFE_BUILTINS else f"it calls {name}()"
    if isinstance(v, type) and issubclass(v, torch.autograd.Function) and not _module_ok(v.__module__):
        for part in ("forward", "backward"):
            fn = getattr(v, part, None)
            why = _code_reason(fn, depth + 1, seen) if isinstance(fn, types.FunctionType) else None
            if why:
                return why
        return None
    module = getattr(v, "__module__", None)
    if isinstance(module, str) and _module_ok(module) and not isinstance(v, types.FunctionType):
        return None  # a torch function or class (torch.tanh, F.gelu, torch.Size)
    if isinstance(v, types.FunctionType):
        if isinstance(module, str) and _module_ok(module):
            return None
        return _code_reason(v, depth + 1, seen)
    if isinstance(v, (staticmethod, classmethod)):
        return _value_reason(name, v.__func__, depth, seen)
    return f"it reads {name!r} (a {type(v).__name__}), which may hold state"


def _code_reason(fn: types.FunctionType, depth: int, seen: set) -> str | None:
    """Why running the Python function ``fn`` may have a side effect, or None (see the NOTE)."""
    code = fn.__code__
    if code in seen:
        return None
    if depth > _DEPTH:
        return f"it calls Python functions more than {_DEPTH} levels deep"
    seen.add(code)
    cells = dict(zip(code.co_freevars, fn.__closure__ or ()))
    return _walk(code, fn.__globals__, cells, depth, seen, own=set(code.co_cellvars))


def _walk(code, scope: dict, cells: dict, depth: int, seen: set, own: set) -> str | None:
    for ins in dis.get_instructions(code):
        op, name = ins.opname, ins.argval
        if op in _WRITES:
            return f"it writes the global {name!r}"
        if op in _CLOSURE_WRITES and name not in own:
            return f"it writes the variable {name!r} of an enclosing function"
        if op == "IMPORT_NAME" and not _module_ok(str(name)):
            return f"it imports {name}"
        if op in ("LOAD_ATTR", "LOAD_METHOD") and name == "distributed":
            return "it uses torch.distributed"
        if op == "LOAD_GLOBAL":
            if name in scope:
                why = _value_reason(name, scope[name], depth, seen)
            elif hasattr(builtins, name):
                why = _value_reason(name, getattr(builtins, name), depth, seen)
            else:
                why = None  # undefined: running it raises NameError, which is caught
            if why:
                return why
        if op in ("LOAD_DEREF", "LOAD_CLOSURE") and name in cells:
            try:
                value = cells[name].cell_contents
            except ValueError:  # an empty cell
                continue
            why = _value_reason(name, value, depth, seen)
            if why:
                return why
    for c in code.co_consts:  # nested functions and comprehensions: the enclosing function's own cells
        if isinstance(c, types.CodeType):
            why = _walk(c, scope, cells, depth, seen, own | set(code.co_cellvars) | set(c.co_cellvars))
            if why:
                return why
    return None


_UNSAFE: dict = {}  # the Function's backward code -> the reason (or None): decided once per code object


def unsafe_reason(cls) -> str | None:
    """Why the backward of the custom Function class ``cls`` may not be run on fake tensors, or None."""
    fn = cls.__dict__.get("backward", getattr(cls, "backward", None))
    if isinstance(fn, (staticmethod, classmethod)):
        fn = fn.__func__
    if not isinstance(fn, types.FunctionType):
        return "its backward is not a Python function"
    key = fn.__code__
    if key not in _UNSAFE:
        _UNSAFE[key] = _code_reason(fn, 0, set())
    return _UNSAFE[key]


class _Allocations(TorchDispatchMode):
    """Every new output storage of the aten calls made inside it, with its life (see the NOTE)."""

    def __init__(self, known) -> None:
        super().__init__()
        self.known = {id(s): s for s in known}  # storages that exist before: never counted
        self.live: dict = {}  # id(storage) -> (weak reference, bytes)
        self.level = self.high = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._saw(t.untyped_storage())
        return out

    def _saw(self, st) -> None:
        key = id(st)
        if key in self.known or key in self.live:
            return
        n = int(st.nbytes())
        self.live[key] = (weakref.ref(st, functools.partial(self._freed, key)), n)
        self.level += n
        self.high = max(self.high, self.level)

    def _freed(self, key: int, _ref=None) -> None:
        got = self.live.pop(key, None)
        if got is not None:
            self.level -= got[1]

    def returned(self, got) -> int:
        """Bytes of the counted storages among the tensors ``got`` (the backward's result) that are alive."""
        seen, total = set(), 0
        for t in tree_flatten(got)[0]:
            if isinstance(t, torch.Tensor):
                key = id(t.untyped_storage())
                if key in self.live and key not in seen:
                    seen.add(key)
                    total += self.live[key][1]
        return total


def measure_fake(sig: dict) -> dict:
    """``{"bytes": n, "how": FAKE}`` for a custom Function's signature, or ``{"error": reason}``."""
    from gradscope.memory.kernels.custom import custom_call, function_class

    try:
        cls = function_class(sig)
    except Unmeasurable as e:
        return {"error": str(e)}
    hint = "; pass run_custom=True to run it on real random tensors and measure it"
    why = unsafe_reason(cls)
    if why:
        return {"error": f"the backward of the custom autograd.Function {sig['function']} was not run: {why}{hint}"}
    mode, refusals = fake_tensor_mode()
    if mode is None:
        return {"error": f"fake tensors are not readable on torch {torch.__version__}{hint}"}
    log = logging.getLogger("torch._subclasses.fake_tensor")  # logs each refused op as an error, traceback
    was = log.disabled  # and all: the refusal is this function's answer, said in its own words
    log.disabled = True
    ctx = None
    try:
        with mode:
            ctx, grads, materialize = custom_call(sig)
            known = [t.untyped_storage() for t in (*ctx.saved_tensors, *grads) if t is not None]
            known += [v.untyped_storage() for v in vars(ctx).values() if isinstance(v, torch.Tensor)]
            tracker = _Allocations(known)
            with torch.no_grad(), tracker:
                got = cls.backward(ctx, *materialize())
                high, kept = tracker.high, tracker.returned(got)
            del got
    except refusals as e:
        text = type(e).__name__
        if "DataDependent" in text:
            what = "it reads tensor values (.item(), a tensor in an if, a conversion to a Python number)"
        elif "DynamicOutputShape" in text:
            what = "it makes a tensor whose shape depends on tensor values"
        else:
            what = f"an op it calls has no fake-tensor kernel ({str(e).splitlines()[0][:100]})"
        return {
            "error": f"the backward of the custom autograd.Function {sig['function']} cannot run on fake "
            f"tensors: {what}{hint}"
        }
    except AttributeError as e:
        name = getattr(e, "name", None)
        if ctx is not None and getattr(e, "obj", None) is ctx and name:
            return {
                "error": f"the backward of the custom autograd.Function {sig['function']} reads ctx.{name}, "
                "which the graph does not record (a tensor kept as a ctx attribute; ctx.save_for_backward "
                "records it)"
            }
        return {"error": f"running {sig['function']}.backward on fake tensors failed ({e}){hint}"}
    except Exception as e:  # noqa: BLE001 - user code: any failure means "not measured", said why
        first = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        return {"error": f"running {sig['function']}.backward on fake tensors failed ({first}){hint}"}
    finally:
        log.disabled = was
    return {"bytes": max(0, int(high - kept)), "how": FAKE}
