"""``gradscope.watch(model)``: a training-loop guard for missing and non-finite gradients.

NOTE [end of backward]
Each watched parameter gets two hooks. ``Tensor.register_hook`` runs just before the gradient is
accumulated into ``.grad`` and is handed ``None`` when the incoming gradient is undefined (a custom
``autograd.Function`` whose backward returned None for it); for a defined gradient it stamps the parameter
with the id of the running graph task (``torch._C._current_graph_task_id()``). A
``register_post_accumulate_grad_hook`` alone would not do: it fires in that None case too, with the old
``.grad`` untouched, so after ``zero_grad(set_to_none=False)`` it cannot tell a received gradient from a
missing one. The post-accumulate hook has the other job: it runs only when a backward writes ``.grad``
(``loss.backward()``, not ``torch.autograd.grad``), and the first time it fires in a graph task it queues
one end-of-backward callback with ``torch.autograd.Variable._execution_engine.queue_callback`` (what DDP's
reducer uses), which runs once the engine has finished that backward. "Received a gradient in this
backward" is then ``stamp >= id of this backward``: graph task ids only grow, so a stale ``.grad``, or a
stamp left by ``autograd.grad`` or by an earlier backward that raised half-way, never counts. A backward
that writes no watched ``.grad`` queues nothing, so another model's backward is not checked.

NOTE [nested backward]
A reentrant ``checkpoint(use_reentrant=True)`` runs a second, nested backward from inside a node of the
outer one; its parameters' hooks fire in the nested graph task, and a callback queued there runs when the
nested backward ends, before the outer one has reached the parameters in front of the checkpoint. The
callback sees that it is nested (``torch._C._current_autograd_node()`` is the outer node, not None) and
moves itself to the outer backward: a one-shot post hook on that outer node queues the callback again,
this time in the outer graph task. Nested task ids are larger than the outer id, so their stamps count.

NOTE [last callback]
Other end-of-backward callbacks may still be queued behind ours: DDP's reducer queues its
``finalize_backward`` (which waits for the all-reduce and writes the averaged gradients into ``.grad``)
when its last bucket is ready, after our first hook. The engine runs callbacks queued by a callback too, so
ours queues itself once more and checks from there, after DDP's: every rank then tests the same averaged
gradients for NaN/Inf, and a NaN on one rank is reported by all of them instead of leaving the others
waiting in the next collective.
"""

from __future__ import annotations

import fnmatch
import os
import sys
import warnings
from types import FrameType
from typing import Any

import torch

from gradscope._torch import current_autograd_node, current_graph_task_id, queue_engine_callback
from gradscope.errors import GradientError, InputTypeError, InputValueError
from gradscope.findings import sort_findings
from gradscope.watching.step import (
    WatchedParam,
    error_message,
    none_grad_findings,
    nonfinite,
    nonfinite_findings,
    rank_text,
)

__all__ = ["watch", "Watch"]

_INTERNAL = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)
_task_id = current_graph_task_id
_current_node = current_autograd_node
_queue = queue_engine_callback


def watch(model, *, on_error="raise", check_nonfinite=True, ignore=(), every=1, accumulate=1,
          scaler=None) -> Watch:
    """Check every backward through ``model`` for parameters that got no gradient and for NaN/Inf.

    At the end of each backward that reached the model, every watched parameter (``requires_grad=True``,
    not ignored) must have received a gradient *in that backward*; a stale ``.grad`` left by
    ``zero_grad(set_to_none=False)`` does not count. With ``check_nonfinite`` the new gradients are also
    tested for NaN/Inf in one batched pass (one sync per device, not one per tensor).

    Args:
        model: the ``nn.Module`` to watch; ``DistributedDataParallel``/``DataParallel`` are unwrapped, so
            names carry no ``module.`` prefix, and errors say which rank found them.
        on_error: ``"raise"`` (a :class:`~gradscope.GradientError` propagates out of ``backward()``),
            ``"warn"`` (a ``RuntimeWarning``), or a callable taking the list of findings.
        check_nonfinite: also check the new gradients for NaN and Inf.
        ignore: parameter names or ``fnmatch`` patterns (``"experts.*"``) never checked: parameters that
            are legitimately unused on some steps (mixture-of-experts, multi-task heads).
        every: check one backward (or one accumulation window) in ``every``.
        accumulate: check once per window of this many backwards (gradient accumulation): a parameter
            counts as used if it received a gradient in any backward of the window, and the NaN/Inf check
            runs on the accumulated gradients at the window's end. With 1, each backward is checked alone.
        scaler: a ``torch.amp.GradScaler``. While it is enabled and its scale is at least 1, NaN/Inf
            gradients are left to it (it skips that optimizer step and lowers the scale); once the scale
            is below 1 they cannot come from loss scaling and are reported.

    Returns:
        A :class:`Watch` guard: call ``.remove()`` when done, or use it as a context manager.

    Raises:
        InputTypeError: ``model`` is not an ``nn.Module``, or an option has the wrong type.
        InputValueError: an option has a bad value, an ``ignore`` pattern matches no parameter, or the
            model has no parameter to watch.

    Example:
        >>> import torch, gradscope
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> with gradscope.watch(model):
        ...     model(torch.randn(2, 4)).sum().backward()      # healthy: nothing raised
    """
    return Watch(model, on_error=on_error, check_nonfinite=check_nonfinite, ignore=ignore, every=every,
                 accumulate=accumulate, scaler=scaler)


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the user's ``backward()`` call, past torch and us."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


class Watch:
    """The guard returned by :func:`watch`; removes every hook it installed on ``.remove()`` / ``with`` exit.

    Attributes:
        backwards: backwards through the model seen so far (nested reentrant backwards count once).
        checks: checks run (one per ``every`` backwards or accumulation windows).
        findings: the findings of the last check that found a problem (empty tuple if none yet).
        skipped_by_scaler: checks whose NaN/Inf gradients were left to the GradScaler.
    """

    def __init__(self, model, *, on_error, check_nonfinite, ignore, every, accumulate, scaler):
        if not isinstance(model, torch.nn.Module):
            raise InputTypeError(f"watch() needs a torch.nn.Module, got {type(model).__name__}: "
                                 f"{model!r:.80}.")
        if not (on_error in ("raise", "warn") or callable(on_error)):
            raise InputValueError(f"on_error must be 'raise', 'warn' or a callable taking the findings, "
                                  f"got {on_error!r}.")
        for opt, value in (("every", every), ("accumulate", accumulate)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputValueError(f"{opt} must be a positive int, got {value!r}.")
        if scaler is not None and not (hasattr(scaler, "is_enabled") and hasattr(scaler, "get_scale")):
            raise InputTypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}.")
        patterns = (ignore,) if isinstance(ignore, str) else tuple(ignore)
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        inner: Any = model.module if ddp or isinstance(model, torch.nn.DataParallel) else model
        named = list(inner.named_parameters())
        for pat in patterns:
            if not isinstance(pat, str):
                raise InputTypeError(f"ignore must hold parameter names or fnmatch patterns, got {pat!r}.")
            if not any(n == pat or fnmatch.fnmatchcase(n, pat) for n, _ in named):
                example = named[0][0] if named else "(none)"
                raise InputValueError(f"ignore pattern {pat!r} matches no parameter of the model; its "
                                      f"parameters are named like {example!r}.")
        self._params = [WatchedParam(n, p, *self._owner(inner, n)) for n, p in named
                        if p.requires_grad and not any(n == pat or fnmatch.fnmatchcase(n, pat)
                                                       for pat in patterns)]
        if not self._params:
            raise InputValueError(f"{type(inner).__name__} has no parameter with requires_grad=True left to "
                                  f"watch (ignore={patterns!r}).")
        self._model_name = type(inner).__name__
        self._ddp_strict = ddp and not getattr(model, "find_unused_parameters", False)
        self._on_error, self._check_nonfinite, self._scaler = on_error, check_nonfinite, scaler
        self._every, self._accumulate, self._ignore = every, accumulate, patterns
        self._stamp = [-1] * len(self._params)      # graph task id of each parameter's last gradient
        self._pending: set[int] = set()             # graph tasks with our callback queued
        self._window_start: int | None = None
        self._in_window = 0
        self._windows = 0
        self._node_hooks: list = []
        self._removed = False
        self.backwards = self.checks = self.skipped_by_scaler = 0
        self.findings: tuple = ()
        self._handles = self._install()

    @staticmethod
    def _owner(root, name: str) -> tuple[str, str]:
        module = name.rpartition(".")[0]
        return module, type(root.get_submodule(module)).__name__

    def _hooks(self, i: int):
        stamp, pending, on_end = self._stamp, self._pending, self._on_end

        def arrived(grad) -> None:                  # NOTE [end of backward]
            if grad is not None:
                stamp[i] = _task_id()

        def accumulated(_param) -> None:
            tid = _task_id()
            if tid not in pending:
                pending.add(tid)
                _queue(on_end)
        return arrived, accumulated

    def _install(self) -> list:
        handles = []
        for i, wp in enumerate(self._params):
            arrived, accumulated = self._hooks(i)
            handles.append(wp.param.register_hook(arrived))
            handles.append(wp.param.register_post_accumulate_grad_hook(accumulated))
        return handles

    def _on_end(self) -> None:
        tid = _task_id()
        self._pending.discard(tid)
        if self._removed:
            return
        node = _current_node()
        if node is not None:                         # NOTE [nested backward]: hand over to the outer task
            handle: Any = None

            def requeue(_grad_inputs, _grad_outputs):
                handle.remove()
                if handle in self._node_hooks:
                    self._node_hooks.remove(handle)
                outer = _task_id()
                if not self._removed and outer not in self._pending:
                    self._pending.add(outer)
                    _queue(self._on_end)
            handle = node.register_hook(requeue)
            self._node_hooks.append(handle)
            return
        _queue(self._on_last)                        # NOTE [last callback]

    def _on_last(self) -> None:
        if self._removed:
            return
        self._pending.clear()                        # ids of earlier backwards that raised half-way
        self._end_of_backward(_task_id())

    def _end_of_backward(self, tid: int) -> None:
        self.backwards += 1
        if self._window_start is None:
            self._window_start = tid
        self._in_window += 1
        if self._in_window < self._accumulate:
            return
        start, n = self._window_start, self._in_window
        self._window_start, self._in_window = None, 0
        self._windows += 1
        if (self._windows - 1) % self._every:
            return
        self.checks += 1
        self._check(start, n)

    def _check(self, start: int, n: int) -> None:
        got: list = []
        missing: list = []
        for wp, s in zip(self._params, self._stamp):
            if wp.param.requires_grad:
                (got if s >= start else missing).append(wp)
        bad = nonfinite(got) if self._check_nonfinite else []
        scale = None
        if bad and self._scaler is not None and self._scaler.is_enabled():
            scale = float(self._scaler.get_scale())
            if scale >= 1.0:
                self.skipped_by_scaler += 1
                bad = []
        if not missing and not bad:
            return
        rank = rank_text()
        where = (f"in this backward (backward {self.backwards}" if n == 1 else
                 f"in the accumulation window of {n} backwards ending at backward {self.backwards}")
        context = where + (f", {rank})" if rank else ")")
        findings = sort_findings(none_grad_findings(missing, context, self._ddp_strict)
                                 + nonfinite_findings(bad, context, scale))
        self.findings = tuple(findings)
        if callable(self._on_error):
            self._on_error(findings)
            return
        message = error_message(missing, bad, context, self._ddp_strict, scale)
        if self._on_error == "warn":
            warnings.warn(message, RuntimeWarning, stacklevel=_user_stacklevel())
        else:
            raise GradientError(message, findings)

    def remove(self) -> None:
        """Remove every hook this guard installed; a callback already queued does nothing. Idempotent."""
        self._removed = True
        for handle in self._handles + self._node_hooks:
            handle.remove()
        self._handles, self._node_hooks = [], []

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        opts = [f"on_error={self._on_error!r}" if isinstance(self._on_error, str) else "on_error=<callable>"]
        if not self._check_nonfinite:
            opts.append("check_nonfinite=False")
        for name, value, default in (("every", self._every, 1), ("accumulate", self._accumulate, 1)):
            if value != default:
                opts.append(f"{name}={value}")
        if self._ignore:
            opts.append(f"ignore={list(self._ignore)!r}")
        if self._scaler is not None:
            opts.append("scaler=GradScaler")
        state = "removed" if self._removed else "active"
        last = f"{len(self.findings)} findings at the last problem" if self.findings else "no problem yet"
        return (f"<gradscope.watch {self._model_name}: {len(self._params)} parameters, {', '.join(opts)}; "
                f"{self.backwards} backwards, {self.checks} checks, {last}; {state}>")
