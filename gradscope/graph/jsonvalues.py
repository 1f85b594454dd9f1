"""Plain JSON values checked without recursion: the primitives of :mod:`gradscope.graph.validation`.

Each ``expect_*`` raises :class:`Bad` naming the field (``nodes[3].saved[0].nbytes: expected an integer >= 0,
got 'x'``); each ``*_ok`` answers yes/no without building a path string (the fast path for a valid file);
:func:`conforms` turns a schema annotation (``str | None``, ``list[int]``, a TypedDict) into such a predicate.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints, is_typeddict

_NONE = type(None)
_SCALARS = (str, float, bool, _NONE)

MAX_DEPTH = 64
MAX_INT = 2**63


class Bad(Exception):
    pass


def type_name(v) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }.get(type(v), type(v).__name__)


def fail(where: str, want: str, v) -> None:
    shown = (
        repr(v)
        if isinstance(v, (int, float, bool, type(None))) or (isinstance(v, str) and len(v) < 40)
        else type_name(v)
    )
    raise Bad(f"{where}: expected {want}, got {shown}")


def expect_int(where, v, low=None, null=False):
    if v is None and null:
        return
    if type(v) is not int or abs(v) >= MAX_INT or (low is not None and v < low):
        fail(where, "an integer" + (f" >= {low}" if low is not None else "") + (" or null" if null else ""), v)


def expect_str(where, v, null=False, choices=None):
    if v is None and null:
        return
    if type(v) is not str or (choices is not None and v not in choices):
        if choices and len(choices) > 8:  # one sentence of a readable length: the first few, and how many
            fail(where, f"one of {', '.join(choices[:4])}, ... ({len(choices)} values)", v)
        fail(where, ("one of " + ", ".join(choices)) if choices else "a string" + (" or null" if null else ""), v)


def expect_bool(where, v):
    if type(v) is not bool:
        fail(where, "true or false", v)


def expect_list(where, v, null=False) -> list:
    if v is None and null:
        return []
    if type(v) is not list:
        fail(where, "a list" + (" or null" if null else ""), v)
    return v


def expect_obj(where, v) -> dict:
    if type(v) is not dict:
        fail(where, "an object", v)
    return v


def expect_shape(where, v, null=False):
    for i, s in enumerate(expect_list(where, v, null)):
        expect_int(f"{where}[{i}]", s, low=-1)


def expect_plain(where, v) -> None:
    """Any JSON value of bounded depth (iterative: a hostile file cannot blow the stack)."""
    stack = [(where, v, 0)]
    while stack:
        w, x, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise Bad(f"{w}: nested more than {MAX_DEPTH} levels deep")
        if type(x) is dict:
            stack.extend((f"{w}.{k}", y, depth + 1) for k, y in x.items())
        elif type(x) is list:
            stack.extend((f"{w}[{i}]", y, depth + 1) for i, y in enumerate(x))
        elif type(x) is int:
            expect_int(w, x)
        elif not isinstance(x, (str, float, bool, type(None))):
            fail(w, "a JSON value", x)


def conforms(hint) -> Callable[[Any], bool]:
    """A predicate: is a parsed JSON value of the annotated type (``str | None``, ``list[int]``, a TypedDict)."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return lambda v: plain_ok(v, 2)
    if origin in (Union, types.UnionType):
        preds = [conforms(a) for a in args]
        return lambda v: any(p(v) for p in preds)
    if origin is Literal:
        return lambda v: type(v) is str and v in args
    if hint is type(None):
        return lambda v: v is None
    if hint is int:
        return lambda v: type(v) is int and -MAX_INT < v < MAX_INT
    if hint in (str, bool, float):
        return lambda v: type(v) is hint
    if origin is list or hint is list:
        item = conforms(args[0]) if args else (lambda v: plain_ok(v, 2))
        return lambda v: type(v) is list and all(item(x) for x in v)
    if origin is dict:
        value = conforms(args[1])
        return lambda v: type(v) is dict and all(type(k) is str and value(x) for k, x in v.items())
    if is_typeddict(hint):
        checks = fields(hint)
        return lambda v: type(v) is dict and all(checks[k](x) if k in checks else plain_ok(x, 2) for k, x in v.items())
    raise TypeError(f"no JSON check for the schema annotation {hint!r}")  # a new annotation kind: add it here


def describe(hint) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(args)
    if origin is list or hint is list:
        return "a list"
    if origin is dict or is_typeddict(hint):
        return "an object"
    return {str: "a string", int: "an integer", bool: "true or false", float: "a number"}.get(hint, "null")


def plain_ok(v, depth: int = 0) -> bool:
    stack = [(v, depth)]
    pop, push = stack.pop, stack.append
    while stack:
        x, d = pop()
        t = type(x)
        if t is int:
            if not -MAX_INT < x < MAX_INT:
                return False
        elif t is list or t is dict:
            if d >= MAX_DEPTH:
                return False
            for y in x if t is list else x.values():
                ty = type(y)
                if ty is int:
                    if not -MAX_INT < y < MAX_INT:
                        return False
                elif ty is list or ty is dict:
                    push((y, d + 1))
                elif ty not in _SCALARS:
                    return False
        elif t not in _SCALARS:
            return False
    return True


def count_ok(v, low=0, null=False) -> bool:
    return (v is None and null) or (type(v) is int and low <= v < MAX_INT)


def shape_ok(v, null=False) -> bool:
    if v is None:
        return null
    return type(v) is list and all(type(s) is int and -1 <= s < MAX_INT for s in v)


def fields(typed) -> dict[str, Callable[[Any], bool]]:
    """Field name -> the predicate of its annotation, for a TypedDict."""
    return {k: conforms(h) for k, h in get_type_hints(typed).items()}
