"""Autograd graphs across training steps: ``carried-graph``, ``retained-graph``, ``graph-without-backward``.

NOTE [step boundary]
A *step* ends with each watched backward; its end-of-backward callback notes the next autograd sequence
number (``_get_sequence_nr``, per thread: on CPU the callback runs on the thread that called backward).
Every node created before that mark belongs to an earlier step. Two forward hooks on the watched root
module do the rest, at a few microseconds per forward:
- the pre-hook looks at the tensor inputs (one level into tuples, lists and dicts): one with a ``grad_fn``
  older than the mark whose graph reaches the model's own parameters is a graph carried across steps (an
  RNN hidden state that was not detached). A tensor from another model (a GAN's ``fake``) does not reach
  them and is left alone;
- the post-hook records each forward that built a graph (sequence range, ``model.training``, the caller's
  line; its output read at any depth, as the inputs are: NOTE [carried state]) and puts one pre-hook on
  each output's ``grad_fn``: it fires when a backward runs that forward's graph (``used``), and since the
  node owns the hook function, a weak reference to that function tells whether the graph is still alive.
  No tensor and no node is kept.
At each boundary, forwards whose graph is still alive from steps before the previous one are graphs the
user keeps (``total_loss += loss``, ``losses.append(loss)``); forwards that no backward used are graphs
built for nothing (an eval loop without ``torch.no_grad()``), reported once per run of such forwards.

NOTE [torch.compile]
When ``torch.compile`` traces the watched module, dynamo inlines its hooks; ours read the autograd sequence
number and the caller's frame, which dynamo cannot trace, so each would split the model's graph and make
torch warn. While dynamo traces, both hand over to a ``torch.compiler.disable`` copy of their work: dynamo
calls it eagerly, before and after the compiled forward, whose graph stays whole, and torch says nothing
(``tests/watch/test_watch_loops.py``); outside dynamo, ``torch.compiler.is_compiling()`` is a cheap False
and the work runs directly. The per-module no-grad hooks (:mod:`gradscope.watching.nograd`) record
nothing while dynamo traces. Code dynamo compiled before ``watch()`` (for this module or another
instance of its class) may keep running without our forward hooks: dynamo does not always guard on hooks
(torch 2.13), so the forward-time checks (graphs across steps, a module run under ``no_grad``, NaN
before a forward) can be off there until it recompiles; the backward's checks (missing and non-finite
gradients, judged at the optimizer step) run either way.
"""

from __future__ import annotations

import inspect as _inspect
import weakref

import torch

from gradscope._format import human_bytes
from gradscope._frames import location_text
from gradscope._torch import peek_sequence_nr, storage_key
from gradscope.findings import Finding
from gradscope.watching.carried import CarriedChecks, tensors_in
from gradscope.watching.holders import find_holders, holder_text, user_frame
from gradscope.watching.safety import InertCopy
from gradscope.watching.walks import graph_stats

__all__ = ["GraphWatch"]

_RECORDS_AT_MOST = 4096


class ForwardRec:
    """One forward of the watched model that built a graph (plain data only)."""

    __slots__ = ("step", "seq0", "seq1", "training", "where", "used", "alive", "bytes", "nodes")

    def __init__(self, step, seq0, seq1, training, where):
        self.step, self.seq0, self.seq1, self.training = step, seq0, seq1, training
        self.where: tuple[str, int] | None = where  # (file, line) of the caller; worded only when reported
        self.used = False
        self.alive: weakref.ref | None = None  # to the backward prehook on its outputs' nodes
        self.bytes: int | None = None
        self.nodes: int | None = None

    @property
    def location(self) -> str | None:
        """``"file.py:LINE"`` of the user's line that called the forward, when known."""
        return None if self.where is None else location_text(*self.where)

    def graph_alive(self) -> bool:
        """Whether the graph of this forward is still alive (its outputs' nodes, which hold our prehook)."""
        return self.alive is not None and self.alive() is not None


def _outputs(output) -> list:
    """The ``grad_fn`` of each tensor in a forward's output, at any depth (a detector's list of dicts, a
    dataclass of tuples), within the bounded read of NOTE [carried state]."""
    if isinstance(output, torch.Tensor):
        return [] if output.grad_fn is None else [output.grad_fn]
    return [t.grad_fn for _, t in tensors_in(output, "output") if t.grad_fn is not None]


class GraphWatch(CarriedChecks):
    """The cross-step checks of one guard (see NOTE [step boundary]); ``report(findings)`` delivers."""

    def __init__(self, root, model_name, param_ids, params, report, before_forward, safety, enabled=True):
        self._safety = safety  # NOTE [never break training]
        self._root_name = model_name
        self._param_ids = param_ids  # id(param) -> name; shared with the guard
        self._params = params  # () -> the watched parameters (tensors)
        self._report, self._before_forward = report, before_forward
        self._mark = peek_sequence_nr()
        self.step = 0
        self._seq0 = 0
        self._records: list[ForwardRec] = []
        self._old_alive: list[int] = []  # per boundary: graphs alive from before the previous step
        self._retained_reported = 0
        self._eval_backwarded = False  # an eval-mode forward was backwarded: eval mode is training
        self._measured_run = False
        self._active = True
        self._enabled = enabled
        self.on_outputs = None  # FSDP2: the guard's hook on each forward's outputs
        self._wasted_at: set = set()  # forward locations already reported without backward
        self._carried_seen = False  # a carried graph already explains graphs kept alive
        self._root = root
        self._modules = list(root.named_modules())
        self._scans = 0
        self._state_hooked: set[int] = set()  # ids of grad_fns with our state pre-hook
        self.step_boundary = None  # () -> sequence number of the optimizer-step boundary, or None
        try:
            self._arg_names = list(_inspect.signature(root.forward).parameters)
        except (TypeError, ValueError):
            self._arg_names = []
        self._handles = [
            root.register_forward_pre_hook(InertCopy(self._pre_hook), with_kwargs=True),  # NOTE [copied modules]
            root.register_forward_hook(InertCopy(self._post_hook)),
        ]
        self._eager_pre = torch.compiler.disable(self._pre_run)
        self._eager_post = torch.compiler.disable(self._post_run)

    def _pre_hook(self, module, args, kwargs):
        if torch.compiler.is_compiling():  # NOTE [torch.compile]
            return self._eager_pre(module, args, kwargs)
        return self._pre_run(module, args, kwargs)

    def _pre_run(self, module, args, kwargs):
        self._safety.run("forward", self._before_forward)
        self._safety.run("graphs", self._pre, module, args, kwargs)

    def _post_hook(self, module, args, output):
        if torch.compiler.is_compiling():  # NOTE [torch.compile]
            return self._eager_post(module, args, output)
        return self._post_run(module, args, output)

    def _post_run(self, module, args, output):
        self._safety.run("graphs", self._post, module, args, output)

    def _pstores(self) -> set[int]:
        out = set()
        for p in self._params():
            try:
                out.add(storage_key(p))
            except (RuntimeError, NotImplementedError, TypeError, ValueError):  # ValueError: a lazy parameter
                pass
        return out

    # -- forward hooks ---------------------------------------------------------------------------
    def _pre(self, module, args, kwargs):
        self._seq0 = peek_sequence_nr()
        if not self._enabled or not torch.is_grad_enabled():
            return None
        mark = self._mark
        if self.step_boundary is None or self.step_boundary() is None:
            self.scan_state(mark)  # NOTE [carried state]: no optimizer known, the boundary is the backward
        for i, value in enumerate(args):
            fn = value.grad_fn if type(value) is torch.Tensor or isinstance(value, torch.Tensor) else None
            if fn is not None or not isinstance(value, (torch.Tensor, int, float, str, bool, type(None))):
                self._scan(value, mark, self._arg_names[i] if i < len(self._arg_names) else f"#{i}")
        for name, value in kwargs.items():
            self._scan(value, mark, name)
        return None

    def _post(self, module, args, output):
        if not torch.is_grad_enabled() or not (self._enabled or self.on_outputs):
            return None
        outs = _outputs(output)
        if not outs:
            return None
        if self.on_outputs is not None:
            self.on_outputs(outs)
        if not self._enabled:
            return None
        frame = user_frame()
        where = None if frame is None else (frame.f_code.co_filename, frame.f_lineno)
        del frame
        rec = ForwardRec(self.step, self._seq0, peek_sequence_nr(), module.training, where)

        def used(_grad_outputs, rec=rec):
            rec.used = True

        for fn in outs:
            fn.register_prehook(used)
        rec.alive = weakref.ref(used)
        records = self._records
        suspicious = (not rec.training and not self._eval_backwarded) or any(
            not r.used and r.step == rec.step for r in records[-4:]
        )
        if suspicious and not self._measured_run:
            self._measured_run = True
            rec.nodes, rec.bytes, _, _ = graph_stats(outs, self._param_ids, self._pstores(), at_least=rec.seq0)
        records.append(rec)
        if len(records) > _RECORDS_AT_MOST:
            del records[: len(records) - _RECORDS_AT_MOST]
        return None

    def _origin(self, seq) -> str:
        for rec in reversed(self._records):
            if rec.seq0 <= seq < rec.seq1:
                return f" (returned by {self._root_name}.forward in step {rec.step + 1}" + (
                    f", called at {rec.location})" if rec.location else ")"
                )
        return ""

    # -- boundaries -----------------------------------------------------------------------------
    def backward_ended(self) -> list[Finding]:
        """Called at the end of every watched backward (a step boundary); returns what to report."""
        self.step += 1
        self._mark = peek_sequence_nr()
        if not self._enabled:
            return []
        self._measured_run = False
        records = self._records
        if any(not r.training and r.used for r in records):
            self._eval_backwarded = True
        findings = self._without_backward(pending_ok=True)
        old = [r for r in records if r.step < self.step - 1 and r.graph_alive()]
        self._old_alive.append(len(old))
        del self._old_alive[:-3]
        self._records = [r for r in records if r.graph_alive() or not r.used]
        grows = len(self._old_alive) == 3 and self._old_alive[0] < self._old_alive[1] < self._old_alive[2]
        if not self._carried_seen and grows and len(old) >= 2 * max(self._retained_reported, 1):
            self._retained_reported = len(old)
            findings.append(self._retained(old))
        return findings

    def close(self) -> list[Finding]:
        """At ``remove()``: forwards that no backward used since the last boundary."""
        self._active = False
        self._root, self._modules = None, []  # hold nothing of the model once removed
        for h in self._handles:
            h.remove()
        self._handles = []
        out = self._without_backward(pending_ok=False)
        self._records = []
        return out

    def _without_backward(self, pending_ok) -> list[Finding]:
        """One ``graph-without-backward`` finding per run of forwards (same step) that no backward used.
        With ``pending_ok``, a run from the step that just ended whose graphs are all still alive waits:
        a later backward may still use them (one loss backwarded after another)."""
        runs: list[list[ForwardRec]] = []
        for r in self._records:
            if r.used:
                continue
            if runs and runs[-1][-1].step == r.step:
                runs[-1].append(r)
            else:
                runs.append([r])
        if pending_ok:
            runs = [run for run in runs if not (run[0].step == self.step - 1 and all(r.graph_alive() for r in run))]
        out = []
        for run in runs:
            for r in run:
                r.used = True  # reported once
            if run[0].where not in self._wasted_at:  # and once per place in the user's code
                self._wasted_at.add(run[0].where)
                out.append(self._wasted(run))
        return out

    def _wasted(self, run) -> Finding:
        n, first = len(run), run[0]
        mode = "in model.eval() mode " if not first.training else ""
        measured = [r for r in run if r.bytes is not None]
        alive = [r for r in run if r.graph_alive()]
        size = (
            f" Each graph held about {human_bytes(measured[0].bytes)} of saved tensors "
            f"({measured[0].nodes} nodes) for as long as its output was kept."
            if measured
            else ""
        )
        held = ""
        if alive:
            holders, _ = find_holders([(r.seq0, r.seq1) for r in alive], self._param_ids, self._pstores())
            if holders:
                held = (
                    f" {len(alive)} of these graphs {'is' if len(alive) == 1 else 'are'} still alive, held by "
                    f"{holder_text(holders)}."
                )
        return Finding(
            "graph-without-backward",
            "warning",
            f"{n} forward{'s' if n != 1 else ''} of {self._root_name} {mode}with gradients enabled"
            + (f" (from {first.location})" if first.location else "")
            + f" built autograd graph{'s' if n != 1 else ''} with saved tensors that no backward used.{size}"
            f"{held} Fix: run evaluation and inference under `with torch.no_grad():` (or "
            f"`torch.inference_mode()`), and call `.item()` on values you keep for logging.",
            location=first.location,
        )

    def _retained(self, old) -> Finding:
        holders, (_, total_nodes, total_bytes) = find_holders(
            [(r.seq0, r.seq1) for r in old], self._param_ids, self._pstores()
        )
        steps = len({r.step for r in old})
        if holders:
            where = (
                f" They are held by {holder_text(holders)}: {total_nodes} autograd nodes and "
                f"{human_bytes(total_bytes)} of saved tensors, growing by about "
                f"{total_nodes // max(steps, 1)} nodes and {human_bytes(total_bytes // max(steps, 1))} "
                f"per step."
            )
            location = holders[0].location
        else:
            where, location = " gradscope could not find which Python variable holds them.", None
        return Finding(
            "retained-graph",
            "warning",
            f"The autograd graphs of {len(old)} forwards of {self._root_name} from {steps} earlier steps are "
            f"still alive, and their number grew at each of the last 3 backwards.{where} A tensor that "
            f"still has a grad_fn keeps its whole graph alive: keep `loss.item()` (a Python float) or "
            f"`loss.detach()` in totals, lists and metric dicts, not `loss` itself.",
            location=location,
        )
