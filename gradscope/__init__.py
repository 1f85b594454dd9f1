"""gradscope: inspect and debug PyTorch autograd graphs.

>>> import gradscope
>>> report = gradscope.inspect(loss, model=model)      # doctest: +SKIP
>>> print(report.summary())                             # doctest: +SKIP

The names below are imported on first use (PEP 562), so ``import gradscope`` and ``gradscope --help`` do
not import torch; a feature whose private torch fact this torch lacks says so at its first use
(``UnsupportedTorchError``), never at import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from gradscope.errors import (
    GradientError,
    GradscopeError,
    InputTypeError,
    InputValueError,
    NoGradRootError,
    RenderError,
    UnknownParameterError,
    UnsupportedTorchError,
)

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from gradscope.compare import Diff, diff
    from gradscope.findings import KINDS, Finding
    from gradscope.inspection import inspect
    from gradscope.memory.sharding.specs import DDP, FSDP
    from gradscope.report import Report, load
    from gradscope.tracing.recorder import trace
    from gradscope.watching.guard import Watch, watch

__version__ = "0.1.0"

#: public name -> the module that defines it (imported when the name is first read).
_LAZY = {
    "inspect": "gradscope.inspection",
    "trace": "gradscope.tracing.recorder",
    "watch": "gradscope.watching.guard",
    "Watch": "gradscope.watching.guard",
    "DDP": "gradscope.memory.sharding.specs",
    "FSDP": "gradscope.memory.sharding.specs",
    "Report": "gradscope.report",
    "load": "gradscope.report",
    "Finding": "gradscope.findings",
    "KINDS": "gradscope.findings",
    "diff": "gradscope.compare",
    "Diff": "gradscope.compare",
}
#: subpackages reachable as attributes (``gradscope.memory.cpu_kernels_on_meta()``) without an import.
_SUBPACKAGES = frozenset({"memory", "graph", "views", "checks", "tracing", "watching", "walk", "cli", "demo"})

__all__ = [
    "inspect",
    "trace",
    "watch",
    "Watch",
    "DDP",
    "FSDP",
    "Report",
    "Finding",
    "KINDS",
    "GradscopeError",
    "GradientError",
    "InputTypeError",
    "InputValueError",
    "NoGradRootError",
    "RenderError",
    "UnknownParameterError",
    "UnsupportedTorchError",
    "load",
    "diff",
    "Diff",
    "__version__",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later reads skip this function
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"gradscope.{name}")
    raise AttributeError(f"module 'gradscope' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _SUBPACKAGES)
