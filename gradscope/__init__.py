"""gradscope: inspect and debug PyTorch autograd graphs.

>>> import gradscope
>>> report = gradscope.inspect(loss, model=model)      # doctest: +SKIP
>>> print(report.summary())                             # doctest: +SKIP
"""

from __future__ import annotations

from .errors import (GradientError, GradscopeError, InputTypeError, InputValueError, NoGradRootError,
                     RenderError, UnknownParameterError)
from .finding import KINDS, Finding
from .inspect_ import inspect
from .report import Report
from .trace_ import trace
from .watch import Watch, watch
from ._json import load
from .diff import Diff, diff

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
