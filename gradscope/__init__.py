"""gradscope: inspect and debug PyTorch autograd graphs.

>>> import gradscope
>>> report = gradscope.inspect(loss, model=model)      # doctest: +SKIP
>>> print(report.summary())                             # doctest: +SKIP
"""

from __future__ import annotations

from gradscope.compare import Diff, diff
from gradscope.errors import (
    GradientError,
    GradscopeError,
    InputTypeError,
    InputValueError,
    NoGradRootError,
    RenderError,
    UnknownParameterError,
)
from gradscope.findings import KINDS, Finding
from gradscope.inspection import inspect
from gradscope.memory.sharding.specs import DDP, FSDP
from gradscope.report import Report, load
from gradscope.tracing.recorder import trace
from gradscope.watching.guard import Watch, watch

__version__ = "0.1.0"

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
    "load",
    "diff",
    "Diff",
    "__version__",
]
