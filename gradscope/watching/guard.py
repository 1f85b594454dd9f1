"""``gradscope.watch(model)``: a training-loop guard for missing and non-finite gradients.

NOTE [end of backward]
Each watched parameter gets two hooks. ``Tensor.register_hook`` runs just before the gradient is accumulated
into ``.grad`` and is handed ``None`` when the incoming gradient is undefined (a custom ``autograd.Function``
whose backward returned None for it); for a defined gradient it notes the id of the running graph task
(``torch._C._current_graph_task_id()``). A ``register_post_accumulate_grad_hook`` alone would not do: it fires
in that None case too, with the old ``.grad`` untouched, so after ``zero_grad(set_to_none=False)`` it cannot
tell a received gradient from a missing one. The post-accumulate hook runs only when a backward writes
``.grad`` (not ``torch.autograd.grad``): it stamps the parameter with the task id when the pre-hook noted a
defined gradient in that task (a gradient never stored in ``.grad``, MAML's inner one, never counts); and the
first time it fires in a graph task it queues one end-of-backward callback with
``torch.autograd.Variable._execution_engine.queue_callback`` (what DDP's reducer uses), which runs once the
engine has finished that backward. "Received a gradient in this backward" is then ``stamp >= id of this
backward``: graph task ids only grow, so a stale ``.grad`` or a stamp left by an earlier backward that raised
half-way never counts. A backward that writes no watched ``.grad`` queues nothing, so another model's backward
is not checked. NOTE [nested backward] and NOTE [last callback] (in :mod:`gradscope.watching.params`) say how
the callback finds the outer backward and runs last.

The cross-step checks (graphs carried or kept across steps, forwards without backward) live in
:mod:`gradscope.watching.graphs`, gradient flow in :mod:`gradscope.watching.flow`, the search for where a
NaN was born in :mod:`gradscope.watching.origin`; every private torch API they use is in
:mod:`gradscope._torch`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

from gradscope._torch import current_graph_task_id
from gradscope.errors import InputTypeError, InputValueError
from gradscope.findings import Finding, sort_findings
from gradscope.watching.flow import Flow, UpdateRatios
from gradscope.watching.fsdp import FsdpStamps, is_fsdp2
from gradscope.watching.graphs import GraphWatch
from gradscope.watching.nanparams import NonfiniteParams
from gradscope.watching.nograd import NoGradCalls
from gradscope.watching.options import WatchOptions, check_model, select
from gradscope.watching.origin import Origin
from gradscope.watching.params import ParamHooks
from gradscope.watching.quiet import Delivery
from gradscope.watching.safety import Safety
from gradscope.watching.step import WatchedParam, check_report
from gradscope.watching.stepping import StepJudge, StepVerdict, step_report

__all__ = ["watch", "Watch"]

#: ``on_error``: ``"raise"``, ``"warn"`` or a callable that receives the list of findings.
OnError = Literal["raise", "warn"] | Callable[[list[Finding]], Any]


def watch(
    model: torch.nn.Module,
    *,
    on_error: OnError = "raise",
    check_nonfinite: bool = True,
    ignore: str | Iterable[str] = (),
    every: int = 1,
    accumulate: int = 1,
    scaler: Any = None,
    graphs: bool = True,
    history: int = 1000,
    vanishing: float = 1e-7,
    exploding: float = 1e3,
    optimizer: torch.optim.Optimizer | None = None,
    ratio_every: int = 100,
    find_origin: bool = True,
) -> Watch:
    """Check every backward through ``model``: missing and non-finite gradients, graphs across steps.

    At the end of each backward that wrote a gradient into the model, every watched parameter
    (``requires_grad=True``, not ignored) must have received a gradient *in that backward*; a stale
    ``.grad`` left by ``zero_grad(set_to_none=False)`` does not count. The new gradients are tested for
    NaN/Inf and their per-module norms recorded in one batched pass (one sync per device).

    Args:
        model: the ``nn.Module`` to watch; ``DistributedDataParallel``, ``DataParallel`` and ``torch.compile``
            are unwrapped (no ``module.``/``_orig_mod.`` in names), and errors say which rank found them.
        on_error: ``"raise"`` (a :class:`~gradscope.GradientError`), ``"warn"`` (a ``RuntimeWarning``,
            once per distinct problem, and a summary at ``remove()``), or a callable taking the findings.
        check_nonfinite: also check the new gradients for NaN and Inf.
        ignore: parameter names or ``fnmatch`` patterns (``"experts.*"``) never checked.
        every: check one backward (or one accumulation window) in ``every``.
        accumulate: check once per window of this many backwards (gradient accumulation).
        scaler: a ``torch.amp.GradScaler``: NaN/Inf are left to it while its scale is at least 1.
        graphs: the cross-step checks: ``carried-graph``, ``retained-graph``, ``graph-without-backward``.
        history: how many checked steps ``guard.history`` keeps (0: none).
        vanishing, exploding: a module whose gradient norm (unscaled by ``scaler``) is below / above
            these is flagged in ``guard.flags`` and in the gradient-flow picture.
        optimizer: when given, ``guard.update_ratios`` records ``||update|| / ||weight||`` per module on
            one ``optimizer.step()`` in ``ratio_every``.
        find_origin: after a non-finite step, instrument the next backward to name the op where the
            NaN/Inf was born (see NOTE [armed backward] in :mod:`gradscope.watching.origin`).

    The options are checked once, into one frozen
    :class:`~gradscope.watching.options.WatchOptions` (``guard.options``).

    Returns:
        A :class:`Watch` guard: call ``.remove()`` when done, or use it as a context manager.

    Raises:
        InputTypeError: ``model`` is not an ``nn.Module``, or an option has the wrong type.
        InputValueError: an option has a bad value, an ``ignore`` pattern matches no parameter, the model
            has no parameter to watch, or a parameter is not a leaf tensor.

    Example:
        >>> import torch, gradscope
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> with gradscope.watch(model):
        ...     model(torch.randn(2, 4)).sum().backward()      # healthy: nothing raised
    """
    options = dict(locals())  # every argument, by name: WatchOptions' fields
    check_model(options.pop("model"))
    return Watch(model, WatchOptions(**options))


class Watch(ParamHooks):
    """The guard returned by :func:`watch`; removes every hook it installed on ``.remove()`` / ``with`` exit.

    Attributes:
        backwards: backwards through the model seen so far (nested reentrant backwards count once).
        checks: checks run (one per ``every`` backwards or accumulation windows).
        findings: the findings of the last check that found a problem (empty tuple if none yet).
        counts: ``{kind: number of findings}`` since ``watch()``.
        skipped_by_scaler: checks whose NaN/Inf gradients were left to the GradScaler.
        history: per checked step, ``{qualified module name: L2 norm of its own parameters' gradients}``.
        flags: ``(backward, module, "vanishing" | "exploding", norm)`` for modules past the thresholds.
        update_ratios: per measured optimizer step, ``{module: ||update|| / ||weight||}``.
        options: the :class:`~gradscope.watching.options.WatchOptions` it was built with (frozen; after
            ``remove()`` without its optimizer, which holds the parameters).
    """

    def __init__(self, model: torch.nn.Module, options: WatchOptions) -> None:
        check_model(model)
        if not isinstance(options, WatchOptions):
            raise InputTypeError(f"Watch(model, options) takes a WatchOptions, got {type(options).__name__}.")
        self.options = opts = options
        self._text = opts.text()  # for the repr, also after remove()
        patterns = opts.ignore
        inner, ddp, chosen = select(model, patterns)
        self._params = [WatchedParam(n, p, *self._owner(inner, n)) for n, p in chosen]
        if not self._params:
            raise InputValueError(
                f"{type(inner).__name__} has no parameter with requires_grad=True left to watch (ignore={patterns!r})."
            )
        self._slots = [(inner.get_submodule(wp.module)._parameters, wp.name.rpartition(".")[2]) for wp in self._params]
        self._param_ids = {id(wp.param): wp.name for wp in self._params}
        self._model_name = type(inner).__name__
        self._safety = Safety(self._model_name)  # NOTE [never break training]
        self._ddp_strict = ddp and not getattr(model, "find_unused_parameters", False)
        self._check_nonfinite, self._scaler = opts.check_nonfinite, opts.scaler
        self._every, self._accumulate, self._ignore = opts.every, opts.accumulate, patterns
        self._stamp = [-1] * len(self._params)  # graph task id of each parameter's last gradient
        self._pending: set[int] = set()  # graph tasks with our callback queued
        self._window_start: int | None = None
        self._in_window = self._windows = 0
        self._node_hooks: list = []
        self._forwards = 0  # forwards of the root since the last check
        self._removed = False
        self.backwards = self.checks = self.skipped_by_scaler = 0
        self._flow = Flow(self._params, history=opts.history, vanishing=opts.vanishing, exploding=opts.exploding)
        self._delivery = Delivery(opts.on_error, self._model_name, self._safety)
        self._origin = Origin(inner, self._safety) if opts.find_origin and opts.check_nonfinite else None
        self._nan = NonfiniteParams()
        self._handles = self._install()
        self._nograd = NoGradCalls(inner, [wp.module for wp in self._params], self._safety)
        self._root, self._index = inner, {wp.name: i for i, wp in enumerate(self._params)}
        self._graphs = GraphWatch(
            inner,
            self._model_name,
            self._param_ids,
            self._tensors,
            self._deliver,
            self._before_forward,
            self._safety,
            enabled=opts.graphs,
        )
        optimizer = opts.optimizer
        self._ratios = (
            UpdateRatios(optimizer, self._params, self._flow, opts.ratio_every, self._safety) if optimizer else None
        )
        self._fsdp = FsdpStamps(self) if is_fsdp2(inner) else None
        self._judge = StepJudge(self, self._safety, self._on_verdict, self._graphs.scan_state)
        self._graphs.step_boundary = lambda: self._judge.boundary
        if self._fsdp is not None:
            self._graphs.on_outputs = self._fsdp.forward

    # -- public state ----------------------------------------------------------------------------
    findings = property(lambda self: self._delivery.last)
    counts = property(lambda self: dict(self._delivery.counts))
    history = property(lambda self: list(self._flow.history))
    flags = property(lambda self: list(self._flow.flags))
    update_ratios = property(lambda self: list(self._flow.ratios))

    def flow_svg(self, path: str | os.PathLike[str] | None = None, *, log: bool = True) -> str:
        """The gradient-flow picture, one row per module, one column per checked step (see ``history``):
        the SVG text, or with ``path`` the file written and its path."""
        from gradscope.watching.flowchart import flow_svg

        return flow_svg(self._flow, f"gradient flow: {self._model_name}", path, log)

    # -- the end of a backward -----------------------------------------------------------------------------------
    def _before_forward(self) -> None:
        self._forwards += 1
        self._refresh()
        poisoned = self._nan.before_forward(self._params, self.backwards)  # NOTE [NaN across steps]
        if poisoned is not None and self._origin is not None:
            self._origin.disarm()
        if self._origin is not None and not self._nan.poisoned:
            self._origin.before_forward()
        if poisoned is not None:
            self._delivery.deliver([poisoned])

    def _last(self) -> None:
        if self._removed:
            return
        self._pending.clear()  # ids of earlier backwards that raised half-way
        tid = current_graph_task_id()
        if self._fsdp is not None:
            self._fsdp.stamp(tid)  # NOTE [FSDP2]
        if max(self._stamp) < tid and self._window_start is None:
            return  # this backward wrote no watched gradient at all
        self._end_of_backward(tid)

    def _end_of_backward(self, tid: int) -> None:
        self.backwards += 1
        late = self._graphs.backward_ended()  # graph findings go out with this check's, if any
        if self._window_start is None:
            self._window_start = tid
        self._in_window += 1
        checked = self._in_window >= self._accumulate
        if checked:
            start, n = self._window_start, self._in_window
            self._window_start, self._in_window = None, 0
            self._windows += 1
            checked = not (self._windows - 1) % self._every
        if not checked:
            self._deliver(late)
            return
        self.checks += 1
        self._check(start, n, tid, late)

    def _check(self, start: int, n: int, tid: int, late=()) -> None:
        if not self._forwards:  # no forward of the root seen: refresh here instead
            self._refresh(tid)
        elif self._lazy:
            self._materialized(tid)
        self._forwards = 0
        params, stamps = self._params, self._stamp
        if min(stamps) >= start:  # every one received a gradient in the window: one C-level pass
            got, missing = list(range(len(stamps))), []
        else:
            got = [i for i, s in enumerate(stamps) if s >= start]  # received one in the window
            missing = [wp for wp, s in zip(params, stamps) if s < start and wp.param.requires_grad]
        scale = None
        if self._scaler is not None and self._scaler.is_enabled():
            scale = float(self._scaler.get_scale())
        bad = self._flow.measure(params, got, self.backwards, scale) if self._check_nonfinite or self._flow.keep else []
        bad = bad if self._check_nonfinite else []
        birth = self._origin.result() if self._origin is not None else None
        if bad and scale is not None:
            if scale >= 1.0:
                self.skipped_by_scaler += 1
                bad = []
        else:
            scale = None
        if bad:
            self._nan.bad_step(self.backwards, birth)
            bad = [] if self._nan.poisoned else bad  # NOTE [NaN across steps]: said once, as nonfinite-param
        if self._origin is not None:
            if bad:
                self._origin.arm()
            else:
                self._origin.disarm()
        if missing and (self._judge.known or self._judge.discover()):
            missing = []  # NOTE [judged at the step]: an optimizer holds them; judged at its step()
        if not missing and not bad:
            self._deliver(late)
            return
        armed, why = self._origin is not None and birth is None, self._nograd.causes()
        self._delivery.deliver(
            *check_report(missing, bad, n, self.backwards, self._ddp_strict, scale, birth, armed, late, why)
        )

    def _on_verdict(self, v: StepVerdict) -> None:
        """What an optimizer step found (NOTE [judged at the step])."""
        if (v.step - 1) % self._every:
            return
        missing = [self._params[i] for i in v.missing]
        unheld = [self._params[i] for i in v.unheld]
        self._delivery.deliver(*step_report(missing, unheld, v, self._ddp_strict, self._nograd.causes()))

    def _deliver(self, findings) -> None:
        if findings:
            self._delivery.deliver(sort_findings(findings))

    def remove(self) -> None:
        """Remove every hook this guard installed and drop its references to the model. Forwards that no
        backward used are reported now (``graph-without-backward``); with ``on_error="warn"`` a summary of
        everything found is warned. Idempotent."""
        if self._removed:
            return
        self._removed = True
        for handles in self._handles:
            for handle in handles:
                handle.remove()
        for handle in self._node_hooks:
            handle.remove()
        self._handles, self._node_hooks = [], []
        self._nograd.remove()
        if self._origin is not None:
            self._origin.disarm()
            self._origin = None
        if self._ratios is not None:
            self._ratios.remove()
            self._ratios = None
        self._judge.remove()
        late = self._graphs.close()
        self._watched = len(self._params)
        self._params, self._slots, self._param_ids, self._index, self._root = [], [], {}, {}, None
        self.options = dataclasses.replace(self.options, optimizer=None)  # its optimizer holds the parameters
        try:
            if late:
                self._deliver(late)
        finally:
            self._delivery.summary(self.backwards)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None:
            self._delivery.hold = True  # do not hide the exception in flight
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else "active"
        n = self._watched if self._removed else len(self._params)
        return (
            f"<gradscope.watch {self._model_name}: {n} parameters, {self._text}; "
            f"{self.backwards} backwards, {self.checks} checks, {self._delivery.counts_text()}; {state}>"
        )
