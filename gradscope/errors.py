"""Exception types raised by gradscope.

Every error a user can cause is one of these, each subclassing the builtin that fits, so
``except TypeError`` in user code keeps working and the CLI can map them to exit code 2.
"""

from __future__ import annotations

__all__ = [
    "GradscopeError",
    "InputTypeError",
    "InputValueError",
    "NoGradRootError",
    "UnknownParameterError",
    "RenderError",
    "GradientError",
    "UnsupportedTorchError",
]


class GradscopeError(Exception):
    """Base class of every error gradscope raises on purpose."""


class InputTypeError(GradscopeError, TypeError):
    """An argument has the wrong type (for example ``inspect(None)``)."""


class InputValueError(GradscopeError, ValueError):
    """An argument has the right type but an unusable value."""


class NoGradRootError(InputValueError):
    """The root tensor has no ``grad_fn`` and does not require grad: there is no graph to inspect."""


class UnknownParameterError(GradscopeError, KeyError):
    """``Report.explain`` was given a name that is not a parameter of the inspected model."""

    def __str__(self) -> str:  # KeyError quotes its message; show it as a sentence instead.
        return str(self.args[0]) if self.args else ""


class RenderError(GradscopeError, RuntimeError):
    """Rendering failed (for example the Graphviz ``dot`` binary is missing)."""


class GradientError(GradscopeError, RuntimeError):
    """Raised by :func:`gradscope.watch` at the end of a backward that left a problem.

    Attributes:
        findings: the ``none-grad`` / ``nonfinite-grad`` findings, most severe first.
    """

    def __init__(self, message: str, findings=()):
        super().__init__(message)
        self.findings = tuple(findings)


class UnsupportedTorchError(GradscopeError, RuntimeError):
    """The installed torch moved a private API a feature relies on (``gradscope/_torchcheck.py``): raised by
    that feature at first use (never at import), naming the feature, the API, the torch version and what
    still works."""
