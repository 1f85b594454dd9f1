"""Resolving a CLI TARGET (``path/to/file.py:function`` or ``package.module:function``) to a report.

Everything a user can get wrong here (a missing file, an unknown function, a syntax or import error in
their file, an exception raised by their function, a return value that is not a tensor) becomes one
:class:`TargetError` whose message is a single line naming the file and line, so the CLI can print it
without a traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect as _pyinspect
import os
import sys
import traceback
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from gradscope._frames import is_user_file
from gradscope.errors import InputValueError

if TYPE_CHECKING:
    from gradscope.tracing.recorder import Trace

__all__ = ["TargetError", "Loaded", "load", "inspect_target"]

_HINT = "write TARGET as path/to/file.py:function or package.module:function"


class TargetError(InputValueError):
    """The CLI TARGET could not be loaded, called, or did not return a loss."""


class Loaded(NamedTuple):
    """What calling a TARGET produced."""

    loss: Any  # a tensor, or what the target returned first (inspect() names a wrong type)
    model: torch.nn.Module | None
    trace: Trace | None


def load(target: str, *, use_trace: bool = True) -> Loaded:
    """Import the function named by ``target``, call it (under :func:`gradscope.trace` when available).

    Args:
        target: ``path/to/file.py:function`` or ``package.module:function``; the function takes no
            arguments and returns a loss tensor or ``(loss, model)``.
        use_trace: record forward-time events with ``gradscope.trace()`` when that API exists.

    Returns:
        A :class:`Loaded` with the loss, the model (or None) and the finished trace (or None).

    Raises:
        TargetError: any user mistake, with a one-line message.
    """
    source, sep, attr = target.rpartition(":")
    if not sep or not source or not attr:
        raise TargetError(f"TARGET {target!r} does not name a function; {_HINT}.")
    is_file = source.endswith(".py") or "/" in source or os.sep in source
    with _cwd_on_path(os.path.dirname(os.path.abspath(source)) if is_file else os.getcwd()):
        module = _import_file(source) if is_file else _import_module(source)
        fn = _lookup(module, attr, target)
        _check_signature(fn, target)
        out, tr = _call(fn, target, use_trace)
    loss, model = _unpack(out, target)
    return Loaded(loss, model, tr)


def inspect_target(target: str, *, use_trace: bool = True):
    """Load ``target`` and return ``gradscope.inspect`` of its loss (see :func:`load`)."""
    from gradscope.errors import GradscopeError
    from gradscope.inspection import inspect

    loaded = load(target, use_trace=use_trace)
    try:
        return inspect(loaded.loss, model=loaded.model, trace=loaded.trace)
    except GradscopeError:
        raise
    except Exception as exc:  # noqa: BLE001 - a graph gradscope cannot read (an exotic tensor type):
        raise TargetError(  # one line for the CLI, never a traceback
            f"gradscope could not read the graph behind {target}'s loss ({_exc_line(exc)}). backward() "
            "may still work: this is a gradscope limitation, please report it with this message."
        ) from None


# -- importing -----------------------------------------------------------------------------------
@contextlib.contextmanager
def _cwd_on_path(folder: str):
    """Let the user's file import its neighbours (as ``python file.py`` would), then restore sys.path."""
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)


def _import_file(path: str):
    if not os.path.exists(path):
        raise TargetError(f"No such file: {path!r}; {_HINT}.")
    if not os.path.isfile(path):
        raise TargetError(f"{path!r} is not a file; {_HINT}.")
    stem = os.path.splitext(os.path.basename(path))[0]
    name = f"_gradscope_target_{stem}" if stem.isidentifier() else "_gradscope_target"
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(path))
    if spec is None or spec.loader is None:
        raise TargetError(f"Cannot import {path!r} as Python source; {_HINT}.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up here
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # noqa: BLE001 - any error of the user's module becomes one clear line
        sys.modules.pop(name, None)
        _raise_import_error(path, exc)
    return module


def _import_module(name: str):
    if not all(part.isidentifier() for part in name.split(".")):
        raise TargetError(f"{name!r} is neither a .py file nor a module name; {_HINT}.")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise TargetError(
                f"No module named {exc.name!r} (importing {name!r}); check the spelling, "
                "install the package, or run from the folder that holds it."
            ) from None
        _raise_import_error(name, exc)
    except BaseException as exc:  # noqa: BLE001 - any error of the user's module becomes one clear line
        _raise_import_error(name, exc)


def _raise_import_error(what: str, exc: BaseException):
    if isinstance(exc, KeyboardInterrupt):
        raise exc
    if isinstance(exc, SyntaxError):
        where = f"{_short(exc.filename)}:{exc.lineno}" if exc.filename else what
        raise TargetError(f"Cannot import {what}: {type(exc).__name__} at {where}: {exc.msg}.") from None
    raise TargetError(f"Importing {what} raised {_exc_line(exc)}.") from None


# -- calling -------------------------------------------------------------------------------------
def _lookup(module, attr: str, target: str):
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            where = target.rpartition(":")[0]
            names = _functions(module)
            known = f"; it defines: {', '.join(names)}" if names else "; it defines no functions"
            raise TargetError(f"{where} has no function {attr!r}{known}.")
        obj = getattr(obj, part)
    if not callable(obj):
        kind = type(obj).__name__
        article = "an" if kind[0] in "aeiou" else "a"
        raise TargetError(
            f"{target} is {article} {kind}, not a function; TARGET must name a "
            "function that takes no arguments and returns a loss or (loss, model)."
        )
    return obj


def _functions(module) -> list[str]:
    out = [
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and _pyinspect.isfunction(v) and v.__module__ == module.__name__
    ]
    return out[:10]


def _check_signature(fn, target: str) -> None:
    try:
        sig = _pyinspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: let the call tell
    try:
        sig.bind()
    except TypeError:
        raise TargetError(
            f"{target} takes arguments {sig}; TARGET must name a function that takes none "
            f"(wrap it: def main(): return {fn.__name__}(...))."
        ) from None


def _call(fn, target: str, use_trace: bool):
    import gradscope

    tracer = getattr(gradscope, "trace", None) if use_trace else None
    try:
        if callable(tracer):
            with tracer() as tr:
                out = fn()
            return out, tr
        return fn(), None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit from user code is a user mistake too
        raise TargetError(f"{target} raised {_exc_line(exc)}.") from None


def _unpack(out, target: str):
    if isinstance(out, torch.Tensor):
        return out, None
    if isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], torch.nn.Module):
        return out[0], out[1]
    try:
        text = " ".join(repr(out).split())  # one line, even for a multi-line repr
    except Exception:  # noqa: BLE001 - a user object whose __repr__ raises
        text = "<unprintable>"
    text = text if len(text) <= 60 else text[:57] + "..."
    raise TargetError(
        f"{target} returned {type(out).__name__} {text}; it must return the loss tensor or a (loss, model) tuple."
    )


# -- one-line messages ---------------------------------------------------------------------------
def _exc_line(exc: BaseException) -> str:
    """``ValueError: message (at file.py:12)``: the exception's first line and the user's frame."""
    try:
        msg = str(exc).strip().splitlines()
    except Exception:  # noqa: BLE001 - an exception whose __str__ itself raises
        msg = ["<its message could not be printed: __str__ raised>"]
    text = f"{type(exc).__name__}: {msg[0]}" if msg else type(exc).__name__
    if len(text) > 300:
        text = text[:297] + "..."
    where = _user_frame(exc)
    return f"{text.rstrip('.')} (at {where})" if where else text.rstrip(".")


def _user_frame(exc: BaseException) -> str | None:
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if is_user_file(frame.filename):  # the one rule of whose code a frame runs (gradscope/_frames.py)
            return f"{_short(frame.filename)}:{frame.lineno}"
    return None


def _short(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel
