"""torch.profiler as the oracle of ``backward_memory()`` on a random training step (``_memprogram``).

``check(prog)`` runs the step once unprofiled (a program whose forward or backward raises is not valid;
the run also warms gradscope's workspace cache, which is not measured while a profiler runs), then once
more from the same seed under ``tests._memtruth.measure``: gradscope's prediction is taken inside the
profiled run, between forward and backward, and compared with what the profiler measured.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import gradscope
from tests._memtruth import measure

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
    unmodelled: bool = False

    @property
    def peak_ok(self) -> bool:
        return abs(self.peak_err) <= PEAK_TOL

    @property
    def levels_ok(self) -> bool:
        return self.order_ok and self.level_err <= LEVEL_TOL

    @property
    def step_ok(self) -> bool:
        return abs(self.step_err) <= STEP_TOL

    def line(self) -> str:
        return (f"seed {self.prog.seed}: order {'ok' if self.order_ok else 'DIFFERS'}, level err {self.level_err} B, "
                f"peak {self.peak_err:+.2%}, step {self.step_err:+.2%}{' (unmodelled)' if self.unmodelled else ''}")


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


def check(prog: MemProgram, inputs: bool = True) -> Outcome:
    """Prediction against measurement for ``prog`` (``inputs``: pass the batch as ``inputs=``)."""
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
    out.step_err = (bm.absolute_peak - truth.absolute_peak) / max(truth.absolute_peak, 1)
    out.unmodelled = bool(bm.unmodelled)
    return out
