"""Where a cut really happened, when the op's own line is not the answer: a forward hook, an
``inference_mode`` region. Plain functions over frames; the caller must not keep a frame or module.

NOTE [cuts in forward hooks]
``register_forward_hook`` hooks run inside ``nn.Module._call_impl``, after the module's forward and after
trace()'s own global hook closed the module's call: a ``.detach()`` there is recorded at the hook's line,
in the parent's call. The hook's frame is the user's frame whose caller is ``_call_impl`` (or the
``inner()`` it defines, torch 2.13) and whose code is the code of that frame's local ``hook``; the
module is that frame's ``self``. Where torch calls hooks some other way, nothing is found and the event
stays a plain cut at the hook's line. The event then names the
hook and the module whose output it cut.

NOTE [inference-mode regions]
Under ``torch.inference_mode()`` every op of the region records a cut at its own line, but the cause is
the region: the decorated function's call (``@torch.inference_mode()`` wraps it in torch's
``decorate_context``, whose ``ctx_factory`` is the ``clone`` method of an ``inference_mode`` object; its
code is that of any function torch decorated so, one of our own here: the same code object up to torch
2.14, a copy renamed after the context manager, at the same file and first line, from 2.15) or
the ``with torch.inference_mode():`` line (found with ``ast`` in the source of the innermost user frame
whose current line lies in such a block). Cloning the region's output afterwards makes a normal tensor
without a graph: the clone is not the cut.
"""

from __future__ import annotations

import ast
import linecache
from types import FrameType

import torch

from gradscope._frames import is_user_file, location_text

__all__ = ["cut_site", "hook_site", "inference_region", "MAX_FRAMES"]

MAX_FRAMES = 64  # frames looked at above an op
# torch's code for these (public names only; NOTE [inference-mode regions] for why they are recognised so):
_MODULE_FILE = torch.nn.modules.module.__file__  # nn.Module's forward hooks are called from code in this file


@torch.inference_mode()
def _decorated() -> None:  # pragma: no cover - never called: its code is torch's decorate_context
    pass


_DECORATE_CODE = _decorated.__code__
_WITH: dict[str, list[tuple[int, int, int]]] = {}  # filename -> (first body line, last line, with line)


def cut_site(kind: str, frame: FrameType | None, location: str | None, extra: dict | None, rec) -> dict | None:
    """``extra`` with a cut's hook (``hook``, ``hook_module_id`` from ``rec.module_key``) or its inference_mode
    region (``location``: the region's, ``op_location``: the op's), when ``frame`` shows one."""
    site = hook_site(frame)
    if site is not None:
        name, module = site
        extra = {**(extra or {}), "hook": name}
        if isinstance(module, torch.nn.Module):
            extra["hook_module_id"] = rec.module_key(module)
    if kind == "no_grad" and torch.is_inference_mode_enabled():
        region = inference_region(frame)
        if region is not None:
            extra = {**(extra or {}), "op_location": location, "location": region}
    return extra


def hook_site(f: FrameType | None) -> tuple[str, object] | None:
    """``(hook name, module)`` when the user's frame ``f`` is a forward hook run by ``nn.Module`` (NOTE above)."""
    if f is None or f.f_back is None or f.f_back.f_code.co_filename != _MODULE_FILE:
        return None
    caller = f.f_back.f_locals
    hook = caller.get("hook")
    hook = getattr(hook, "func", hook)  # functools.partial: its func
    if getattr(hook, "__code__", None) is f.f_code:  # a function or a bound method
        return f.f_code.co_name, caller.get("self")
    call = type(hook).__call__ if callable(hook) else None
    if getattr(call, "__code__", None) is f.f_code:  # a callable object
        return type(hook).__name__, caller.get("self")
    return None


def inference_region(f: FrameType | None) -> str | None:
    """``"file.py:LINE"`` of the ``inference_mode`` region around the op run from frame ``f`` (NOTE above)."""
    for _ in range(MAX_FRAMES):
        if f is None:
            return None
        code = f.f_code
        if code is _DECORATE_CODE or (
            code.co_firstlineno == _DECORATE_CODE.co_firstlineno and code.co_filename == _DECORATE_CODE.co_filename
        ):
            if isinstance(getattr(f.f_locals.get("ctx_factory"), "__self__", None), torch.inference_mode):
                caller = f.f_back
                while caller is not None and not is_user_file(caller.f_code.co_filename):
                    caller = caller.f_back
                return None if caller is None else location_text(caller.f_code.co_filename, caller.f_lineno)
        elif is_user_file(code.co_filename):
            line = _with_line(code.co_filename, f.f_lineno)
            if line is not None:
                return location_text(code.co_filename, line)
        f = f.f_back
    return None


def _with_line(filename: str, lineno: int) -> int | None:
    blocks = _WITH.get(filename)
    if blocks is None:
        blocks = _WITH[filename] = _with_blocks(filename)
    inner = None
    for first, last, line in blocks:
        if first <= lineno <= last and (inner is None or line > inner):
            inner = line
    return inner


def _with_blocks(filename: str) -> list[tuple[int, int, int]]:
    source = "".join(linecache.getlines(filename))
    if "inference_mode" not in source:
        return []
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)) and node.body:
            if any("inference_mode" in ast.unparse(item.context_expr) for item in node.items):
                out.append((node.body[0].lineno, node.end_lineno or node.body[-1].lineno, node.lineno))
    return out
