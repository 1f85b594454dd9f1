"""The line of a module's own code that writes an attribute or buffer (for ``carried-graph``).

NOTE [the line that wrote it]
A graph kept in a buffer or attribute is found at the backward that reaches it, long after the write.
The write itself (``self.bank.index_copy_(0, idx, f)``, ``self.buf[idx] = v``, ``self.buf[:n].copy_(v)``,
``self.cache = f(self.weight)``) is read from the source of the module's class (or the first of its bases
outside torch that writes it), once per class and name: an assignment to ``self.<name>`` or to an item
of it, or a call of an in-place method (``..._``) on it or on an item of it, in any method but
``__init__``, outside ``with torch.no_grad():`` blocks (and not an assignment of ``None``). None when
the source is not readable or no such line is found.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap

import torch

__all__ = ["written_at"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_CACHE: dict[tuple[type, str], str | None] = {}


def written_at(cls: type, name: str) -> str | None:
    """``"file.py:LINE"`` of the line of ``cls``'s code that writes ``self.<name>`` (NOTE above); several
    such lines are said as ``"a.py:3, a.py:7 or a.py:9"`` (the first three)."""
    key = (cls, name)
    if key not in _CACHE:
        if len(_CACHE) > 1024:
            _CACHE.clear()
        _CACHE[key] = _find(cls, name)
    return _CACHE[key]


def _find(cls: type, name: str) -> str | None:
    found: list[str] = []
    for klass in cls.__mro__:
        if klass is object or klass.__module__.startswith("torch"):
            continue
        try:
            lines, start = inspect.getsourcelines(klass)
            path = inspect.getsourcefile(klass) or ""
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except (OSError, TypeError, SyntaxError, ValueError):
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name == "__init__" or not fn.args.args:
                continue
            me = fn.args.args[0].arg
            for node in _outside_no_grad(fn):
                if _writes(node, me, name):
                    found.append(f"{os.path.basename(path)}:{start + getattr(node, 'lineno', 1) - 1}")
        if found:
            break
    found = sorted(set(found), key=lambda w: int(w.rpartition(":")[2]))
    if not found:
        return None
    return (
        found[0]
        if len(found) == 1
        else ", ".join(found[:2]) + f" or {found[2]}"
        if len(found) > 2
        else " or ".join(found)
    )


def _outside_no_grad(fn):
    """The nodes of ``fn`` not inside a ``with torch.no_grad():`` / ``inference_mode()`` block."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.With, ast.AsyncWith)) and any(
            "no_grad" in ast.unparse(i.context_expr) or "inference_mode" in ast.unparse(i.context_expr)
            for i in node.items
        ):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _is_target(node, me: str, name: str) -> bool:
    if isinstance(node, ast.Subscript):
        node = node.value
    return (
        isinstance(node, ast.Attribute)
        and node.attr == name
        and isinstance(node.value, ast.Name)
        and node.value.id == me
    )


def _writes(node, me: str, name: str) -> bool:
    if isinstance(node, ast.Assign):
        if isinstance(node.value, ast.Constant) and node.value.value is None:
            return False
        return any(_is_target(t, me, name) for t in node.targets)
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return _is_target(node.target, me, name)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return (
            node.func.attr.endswith("_")
            and not node.func.attr.startswith("_")
            and _is_target(node.func.value, me, name)
        )
    return False
