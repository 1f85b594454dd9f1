"""The one answer to "is this frame the user's?", for every place that names the user's line.

A frame is the user's unless its code lives in torch, in gradscope (except ``gradscope/demo.py``, which
*is* example user code: the demo's findings point at its lines), or in Python's frozen import machinery
(``<frozen importlib._bootstrap>``, between the CLI and the target file it loads). Code typed at a prompt
or in a notebook cell (``<stdin>``, ``<ipython-input-...>``) is the user's.

The caller must not keep a frame it gets here: a frame holds the user's local variables (tensors among them).
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import overload

import torch

__all__ = ["is_user_file", "user_frame", "user_caller", "frame_location", "location_text"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_USER_FILES = frozenset({_PACKAGE_DIR + "demo.py"})
_USER: dict[str, bool] = {}  # filename -> is_user_file(filename); filenames are few


def is_user_file(filename: str) -> bool:
    """Whether code in ``filename`` (a code object's ``co_filename``) is the user's.

    Example:
        >>> import torch, gradscope.demo
        >>> is_user_file(torch.__file__), is_user_file(__file__), is_user_file(gradscope.demo.__file__)
        (False, False, True)
        >>> is_user_file("<frozen importlib._bootstrap>"), is_user_file("<stdin>"), is_user_file("train.py")
        (False, True, True)
    """
    known = _USER.get(filename)
    if known is None:
        if filename.startswith("<"):
            known = not filename.startswith("<frozen ")
        else:
            path = os.path.abspath(filename)
            known = not path.startswith(_TORCH_DIR) and (not path.startswith(_PACKAGE_DIR) or path in _USER_FILES)
        _USER[filename] = known
    return known


def user_frame(f: FrameType | None) -> FrameType | None:
    """``f`` or the first frame it was called from whose code is the user's (None: none is)."""
    while f is not None and not is_user_file(f.f_code.co_filename):
        f = f.f_back
    return f


def user_caller(depth: int = 1) -> FrameType | None:
    """The first frame whose code is the user's, from ``depth`` frames up (1: the function calling this)."""
    return user_frame(sys._getframe(depth))


@overload
def frame_location(frame: FrameType) -> str: ...
@overload
def frame_location(frame: None) -> None: ...
@overload
def frame_location(frame: FrameType | None) -> str | None: ...


def frame_location(frame: FrameType | None) -> str | None:
    """``"file.py:LINE"`` (the file's base name) of ``frame``'s current line; None for no frame."""
    if frame is None:
        return None
    return location_text(frame.f_code.co_filename, frame.f_lineno)


def location_text(filename: str, line: int) -> str:
    """``"file.py:LINE"``: the base name of ``filename`` and the line."""
    return f"{os.path.basename(filename)}:{line}"
