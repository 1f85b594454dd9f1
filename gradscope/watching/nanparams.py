"""``nonfinite-param``: weights that are already NaN/Inf before a forward (NOTE [NaN across steps]).

NOTE [NaN across steps]
In a loop that goes on after a non-finite step (``on_error="warn"``, a callable, or a caught error), the
optimizer applies the NaN gradients and the weights become NaN: every later forward computes NaN, and the
per-node search of NOTE [armed backward] (in :mod:`gradscope.watching.origin`) can only say that the loss
was already NaN in the forward, once per parameter. So the guard remembers where gradients first went
non-finite (the backward, and the op, its module and forward line once an armed backward found them);
after a non-finite step, the next forward of the model first reads the watched weights (one norm pass,
only then). If some are not finite, one ``nonfinite-param`` finding names them and points back to that
backward and op, and the per-gradient NaN findings stop while the weights stay non-finite (each forward
re-reads them until they are finite again, e.g. restored from a checkpoint).
"""

from __future__ import annotations

import math
from typing import Any

from gradscope.findings import ERROR, NONFINITE_PARAM, Finding
from gradscope.watching.flow import group_norms
from gradscope.watching.step import birth_text, where_text

__all__ = ["NonfiniteParams"]

_LIST_AT_MOST = 12


class NonfiniteParams:
    """One guard's memory of its first non-finite step, and the check of the weights after it."""

    def __init__(self) -> None:
        self.suspect = False  # a non-finite step was seen: read the weights at the next forward
        self.poisoned = False  # the weights are non-finite (said once)
        self._first: int | None = None  # the backward whose gradients first went non-finite
        self._birth: tuple[Any, int] | None = None  # (Birth, backward) of the first op an armed backward found

    def bad_step(self, backward: int, birth) -> None:
        """A check found non-finite gradients at ``backward`` (with the armed search's ``birth``, if any)."""
        self.suspect = True
        if self._first is None:
            self._first = backward
        if birth is not None and birth.op != "the forward" and self._birth is None:
            self._birth = (birth, backward)

    def before_forward(self, params, backwards: int) -> Finding | None:
        """At a forward after a non-finite step: the finding, the first time the weights are not finite."""
        if not (self.suspect or self.poisoned):
            return None
        live = [wp for wp in params if wp.param.requires_grad and wp.param.numel()]
        norms = group_norms([wp.param.detach() for wp in live])
        bad = [wp for wp, n in zip(live, norms) if not math.isfinite(n)]
        self.suspect = False
        if not bad:
            self.poisoned = False
            return None
        if self.poisoned:
            return None
        self.poisoned = True
        return self._finding(bad, backwards)

    def _finding(self, bad, backwards: int) -> Finding:
        n = len(bad)
        names = "; ".join(f"{wp.name} ({where_text(wp)})" for wp in bad[:_LIST_AT_MOST])
        more = f", and {n - _LIST_AT_MOST} more" if n > _LIST_AT_MOST else ""
        if self._birth is not None:
            birth, at = self._birth
            origin = f" At backward {at}: {birth_text(birth)}"
            location = birth.location
        else:
            origin = (
                " The backward where they first went non-finite was not instrumented (healthy steps pay "
                "nothing); to name the op, restore the weights and run the step again: the guard is armed."
            )
            location = None
        return Finding(
            NONFINITE_PARAM,
            ERROR,
            f"{n} parameter{'s' if n != 1 else ''} already hold{'s' if n == 1 else ''} NaN or Inf before the "
            f"forward after backward {backwards}: {names}{more}. The optimizer applied the non-finite "
            f"gradients of backward {self._first} (the first non-finite step), so every later step computes "
            f"NaN from these weights; gradscope stops reporting each NaN gradient until they are finite "
            f"again.{origin} Fix that cause, then restore the weights from a checkpoint taken before backward "
            f"{self._first}: NaN weights do not recover by training on.",
            params=tuple(wp.name for wp in bad),
            location=location,
        )
