"""torch.profiler as the oracle of ``backward_memory()`` on a random training step (``_memprogram``).

``check(prog)`` runs the step once unprofiled (a program whose forward or backward raises is not valid;
the run also warms gradscope's workspace cache, which is not measured while a profiler runs), then once
more from the same seed under ``tests._memtruth.measure``: gradscope's prediction is taken inside the
profiled run, between forward and backward, and compared with what the profiler measured. With
``steps=True`` (the default) the program then runs as a training loop of three steps from the same seed
(``tests._steptruth.measure_steps``: ``zero_grad()`` between steps, a new batch's ``.grad`` empty): the
prediction taken at step 1 must give step 1 (``bm.first_step``) and the highest step (``bm.absolute_peak``,
the steady state included).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import gradscope
from tests._memtruth import measure
from tests._steptruth import measure_steps

from ._memprogram import MemProgram, build

__all__ = ["Outcome", "check", "PEAK_TOL", "LEVEL_TOL", "STEP_TOL"]

PEAK_TOL = 0.01  #: backward peak, relative
LEVEL_TOL = 4096  #: every level after a node, bytes
STEP_TOL = 0.02  #: the absolute step peak, relative


@dataclass
class Outcome:
    prog: MemProgram
    valid: bool = True
    why: str = ""
    order_ok: bool = False
    level_err: int = 0  # the largest |predicted - measured| level after a node
    peak_err: float = 0.0  # (predicted - measured) / measured backward peak
    step_err: float = 0.0  # the same for the absolute step peak
    first_err: float = 0.0  # bm.first_step against step 1 of three real steps
    steady_err: float = 0.0  # bm.absolute_peak against the highest of three real steps
    unmodelled: bool = False
    uncounted: bool = False  # something alive at backward's start is named as not counted

    @property
    def peak_ok(self) -> bool:
        return abs(self.peak_err) <= PEAK_TOL

    @property
    def levels_ok(self) -> bool:
        return self.order_ok and self.level_err <= LEVEL_TOL

    @property
    def step_ok(self) -> bool:
        return abs(self.step_err) <= STEP_TOL and abs(self.first_err) <= STEP_TOL and abs(self.steady_err) <= STEP_TOL

    @property
    def labelled(self) -> bool:
        """A lower bound the answer says it is."""
        return self.unmodelled or self.uncounted

    def line(self) -> str:
        return (f"seed {self.prog.seed}: order {'ok' if self.order_ok else 'DIFFERS'}, level err {self.level_err} B, "
                f"peak {self.peak_err:+.2%}, step {self.step_err:+.2%}, first of 3 steps {self.first_err:+.2%}, "
                f"steady {self.steady_err:+.2%}{' (unmodelled)' if self.unmodelled else ''}"
                f"{' (uncounted)' if self.uncounted else ''}")


def _step(prog: MemProgram, profiled: bool, inputs: bool):
    built = build(prog)
    traces: list = []

    def forward():
        if prog.traced:
            with gradscope.trace() as tr:
                loss = built.loss()
            traces.append(tr)
        else:
            loss = built.loss()
        return loss, built.model

    def inspect(loss, model):
        return gradscope.inspect(loss, model=model, trace=traces[-1] if traces else None)

    kw = {"inputs": built.inputs} if inputs else {}

    def predict(report, opt):
        return report.backward_memory(optimizer=opt, retain_graph=prog.retain_graph, **kw)

    if profiled:
        return measure(forward, inspect=inspect, predict=predict, optimizer=built.optimizer,
                       retain_graph=prog.retain_graph, before=built.inputs)
    loss, model = forward()
    predict(inspect(loss, model), built.optimizer)
    loss.backward(retain_graph=prog.retain_graph)
    if built.optimizer is not None:
        built.optimizer.step()
    return None


def _steps(prog: MemProgram, inputs: bool):
    """Three steps of ``prog`` as a training loop, the prediction taken at step 1."""
    built = build(prog)
    traces: list = []

    def loss_fn(model, *batch):
        if prog.traced:
            with gradscope.trace() as tr:
                loss = model(*batch)
            traces.append(tr)
            return loss
        return model(*batch)

    def predict(loss):
        report = gradscope.inspect(loss, model=built.model, trace=traces[-1] if traces else None)
        kw = {"inputs": built.inputs} if inputs else {}
        return report.backward_memory(optimizer=built.optimizer, retain_graph=prog.retain_graph, **kw)

    def after_step():
        for t in built.inputs:
            t.grad = None  # a new batch every step

    return measure_steps(built.model, lambda s, k: built.inputs, loss_fn, built.optimizer, steps=3,
                         before=built.inputs, retain_graph=prog.retain_graph, predict=predict, after_step=after_step)


def check(prog: MemProgram, inputs: bool = True, steps: bool = True) -> Outcome:
    """Prediction against measurement for ``prog`` (``inputs``: pass the batch as ``inputs=``; ``steps``:
    also run three steps of the loop and check the first and the steady state)."""
    out = Outcome(prog)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            _step(prog, False, inputs)
        except RuntimeError as e:  # torch refused the program (an in-place write on a saved tensor...)
            out.valid, out.why = False, str(e).splitlines()[0][:120]
            return out
        truth = _step(prog, True, inputs)
    bm = truth.prediction
    out.order_ok = list(bm.names) == truth.order
    out.level_err = (max((abs(a - b) for a, b in zip(bm.levels, truth.levels)), default=0)
                     if len(bm.levels) == len(truth.levels) else 1 << 40)
    out.peak_err = (bm.peak - truth.peak) / max(truth.peak, 1)
    out.step_err = (bm.first_step.absolute_peak - truth.absolute_peak) / max(truth.absolute_peak, 1)  # one step
    out.unmodelled = bool(bm.unmodelled)
    out.uncounted = bool(bm.uncounted)
    if steps:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loop = _steps(prog, inputs)
        bm3, measured = loop["prediction"], loop["steps"]
        out.first_err = (bm3.first_step.absolute_peak - measured[0]) / max(measured[0], 1)
        out.steady_err = (bm3.absolute_peak - max(measured)) / max(max(measured), 1)
    return out
