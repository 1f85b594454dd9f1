"""The guard never breaks training: a failure in its own bookkeeping becomes one warning and that check
switches off (NOTE [never break training]).

NOTE [never break training]
Every hook and callback the guard installs runs inside the user's ``forward()``, ``backward()`` or
``optimizer.step()``. An exception of ours there would stop a healthy run, so each one runs through
:meth:`Safety.run`: our own :class:`~gradscope.errors.GradientError` (a finding, under
``on_error="raise"``) and whatever the user's ``on_error`` callable raises go through; anything else is
a failure of gradscope's bookkeeping: it is warned once, naming the check and the error, and that check
is switched off for the rest of the run (the others go on). The gradients are never touched.

NOTE [copied modules]
torch pickles a module's and an optimizer's hook dicts with them, so ``torch.save(model)`` (a whole-model
checkpoint) and ``copy.deepcopy(model)`` (a target network, an EMA copy) copy our hooks too: a bound
method would drag the whole guard along, and its lambdas cannot be pickled at all, so ``torch.save``
failed. Each hook the guard puts in such a dict is an :class:`InertCopy`: called, it runs the guard's
code (a ``functools.partial`` call, C-level); copied or pickled, it becomes
``functools.partial(sys.audit, ...)``, which does nothing and needs only the standard library, so the
file loads where gradscope is not installed and a copy is not watched. torch drops tensor hooks when it
pickles a tensor (silently for an ``nn.Parameter``, with a warning for a plain tensor); ours are marked
``torch.utils.hooks.unserializable_hook`` so that none warns (docs/internals.md#hooks-and-copies).
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any

from gradscope.errors import GradientError

__all__ = ["Safety", "InertCopy"]


class Safety:
    """Which of a guard's checks are still on, and the one warning when one fails."""

    def __init__(self, model_name: str):
        self._model_name = model_name
        self.off: dict[str, str] = {}  # check -> the error that switched it off
        self.passing: BaseException | None = None  # raised by the user's on_error callable: let it through

    def run(self, check: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or None once ``check`` is off; a failure of ours switches ``check`` off."""
        if check in self.off:
            return None
        try:
            return fn(*args)
        except GradientError:
            raise
        except Exception as exc:
            if exc is self.passing:
                self.passing = None
                raise
            self.failed(check, exc)
            return None

    def failed(self, check: str, exc: BaseException) -> None:
        """Switch ``check`` off with one ``RuntimeWarning`` (training goes on)."""
        if check in self.off:
            return
        self.off[check] = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"gradscope.watch {self._model_name}: its {check} check failed inside gradscope "
            f"({type(exc).__name__}: {str(exc)[:300]}) and is switched off for the rest of this run; training "
            f"and the gradients are not affected, the other checks go on. Please report this error to "
            f"gradscope with the model's layout.",
            RuntimeWarning,
            stacklevel=2,
        )


class InertCopy(functools.partial):
    """A hook in a dict torch copies with its owner: a no-op once copied or pickled (NOTE [copied modules])."""

    def __reduce__(self):
        return functools.partial, (sys.audit, "gradscope.watch: a copy of a watched module's hook, inert")

    def __deepcopy__(self, memo):
        return functools.partial(sys.audit, "gradscope.watch: a copy of a watched module's hook, inert")
