"""gradscope: inspect and debug PyTorch autograd graphs.

>>> import gradscope
>>> report = gradscope.inspect(loss, model=model)      # doctest: +SKIP
>>> print(report.summary())                             # doctest: +SKIP
"""

from __future__ import annotations

from gradscope.errors import (GradientError, GradscopeError, InputTypeError, InputValueError, NoGradRootError,
                     RenderError, UnknownParameterError)
from gradscope.findings import KINDS, Finding
from gradscope.inspection import inspect
from gradscope.report import Report
from gradscope.tracing.recorder import trace
from gradscope.watching.guard import Watch, watch
from gradscope.report import load
from gradscope.compare import Diff, diff

__version__ = "0.1.0"

__all__ = [
    "inspect",
    "trace",
    "watch",
    "Watch",
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
