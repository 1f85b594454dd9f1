"""How a guard's findings reach the user: ``on_error`` raise / warn / callable, once per distinct problem.

Warnings never raise: with ``on_error="raise"`` a ``GradientError`` carries the error-severity findings
only, and warning-severity ones (``graph-without-backward``, ``retained-graph``, ``not-optimized``) are
warned as under ``"warn"``.

With ``on_error="warn"`` each distinct problem (its kind, parameters and place; never the step number) is
warned once, with a message that names no step, so Python's own warning filter can dedupe it too; every
occurrence is counted (``guard.counts``, shown by ``repr(guard)``), and ``remove()`` warns one summary.
"""

from __future__ import annotations

import warnings
from collections import Counter

from gradscope.errors import GradientError
from gradscope.findings import ERROR, NONE_GRAD, NONFINITE_GRAD
from gradscope.watching.holders import user_frame

__all__ = ["Delivery"]


def _stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the user's line, past torch and gradscope."""
    import sys
    from types import FrameType

    target, level = user_frame(2), 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame is not target:
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1


def _key(f) -> tuple:
    return (f.kind, f.params, f.location if f.kind not in (NONE_GRAD, NONFINITE_GRAD) else None)


class Delivery:
    def __init__(self, on_error, model_name: str, safety=None):
        self.on_error, self.model_name = on_error, model_name
        self._safety = safety  # told what the user's callable raised, to let it through
        self.last: tuple = ()
        self.counts: Counter = Counter()
        self._params: dict[str, set] = {}
        self._warned: set = set()
        self.repeated = 0  # warnings not warned again (said once; counted in the summary)
        self.hold = False  # an exception is in flight: record, do not raise

    def deliver(self, findings, message: str | None = None, quiet: str | None = None) -> None:
        if not findings:
            return
        self.last = tuple(findings)
        for f in findings:
            self.counts[f.kind] += 1
            self._params.setdefault(f.kind, set()).update(f.params)
        if callable(self.on_error):
            try:
                self.on_error(list(findings))
            except Exception as exc:
                if self._safety is not None:
                    self._safety.passing = exc
                raise
            return
        raising = self.on_error == "raise" and not self.hold
        errors = [f for f in findings if f.severity == ERROR] if raising else []
        rest = [f for f in findings if f.severity != ERROR] if raising else list(findings)
        if rest:
            self._warn(rest, quiet if not errors and len(rest) == len(findings) else None)
        if errors:
            if message is None:
                message = "\n".join(f"gradscope.watch: {f.kind} ({f.severity}): {f.message}" for f in errors)
            raise GradientError(message, errors)

    def _warn(self, findings, quiet: str | None) -> None:
        new = [f for f in findings if _key(f) not in self._warned]
        self.repeated += len(findings) - len(new)
        if not new:
            return
        self._warned.update(_key(f) for f in new)
        text = (
            quiet
            if quiet is not None and len(new) == len(findings)
            else "\n".join(f"gradscope.watch: {f.kind} ({f.severity}): {f.message}" for f in new)
        )
        warnings.warn(text, RuntimeWarning, stacklevel=_stacklevel())

    def counts_text(self) -> str:
        if not self.counts:
            return "no problem yet"
        return "found " + ", ".join(f"{k} x{n}" for k, n in sorted(self.counts.items()))

    def summary(self, backwards: int) -> None:
        """At ``remove()``: one warning with the count of each kind (under ``"raise"``: when a warning
        was repeated: the errors raised already)."""
        if callable(self.on_error) or not self.counts:
            return
        if self.on_error == "raise" and not self.repeated:
            return
        parts = []
        for kind, n in sorted(self.counts.items()):
            names = sorted(self._params.get(kind, ()))
            shown = f" ({', '.join(names[:6])}{', ...' if len(names) > 6 else ''})" if names else ""
            parts.append(f"{kind} {n} time{'s' if n != 1 else ''}{shown}")
        warnings.warn(
            f"gradscope.watch {self.model_name}: summary over {backwards} backwards: " + "; ".join(parts) + ".",
            RuntimeWarning,
            stacklevel=_stacklevel(),
        )
