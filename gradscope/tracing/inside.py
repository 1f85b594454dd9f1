"""Cuts made inside an ``autograd.Function`` that show only after it returns.

NOTE [cuts that show after a Function returns]
Ops inside a custom Function's forward run under no_grad by autograd's doing and are no cuts (NOTE [cuts
inside autograd.Function]), but two things made there can still cut the loss's path:

- An output marked ``ctx.mark_non_differentiable(...)`` comes back without a gradient. The mode follows
  every tensor the forward computes from its grad-requiring inputs as a pending cut (NOTE [where a cut
  joins], with a :class:`Pending` in place of an event index). When a later op that makes nodes takes one
  that still requires no grad, the event is recorded then, at the line that called ``apply``; an output
  the Function made differentiable requires grad by then and is dropped. The parameters behind the
  Function's grad-requiring inputs are found once per call, at its first such op (one bounded walk, as
  for any cut), because the inputs and the ctx may be gone when the output is used.
- A reentrant checkpoint (``use_reentrant=True``) only differentiates its top-level tensor arguments; a
  tensor with a graph that reaches the body inside a tuple, list, dict or dataclass (or captured from
  outside) is not one of them. The first body op that takes such a tensor records a ``checkpoint-input``
  event at the ``checkpoint(...)`` line, with the region's number and the parameters behind that tensor;
  the parameters join the region's (NOTE [parameters inside reentrant checkpoint]), so a region in the
  graph still gives them gradients and a region that never made a node is the cut.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from types import FrameType

import torch

from gradscope._frames import frame_location, user_frame
from gradscope._torch import peek_sequence_nr
from gradscope.tracing.probes import checkpoint_region, is_function_forward

__all__ = ["Pending", "InsideFunctions", "MAX_NESTED"]

_Tensor = torch.Tensor
MAX_NESTED = 256  # container entries searched for a checkpoint argument


class Pending:
    """A custom Function call whose outputs are followed until one shows it was returned without a gradient."""

    __slots__ = ("function", "location", "params", "index")

    def __init__(self, function: str, location: str | None, params: tuple):
        self.function = function
        self.location = location
        self.params = params  # ids of the parameters behind its grad-requiring inputs
        self.index: int | None = None  # the event, once recorded


class InsideFunctions:
    """What the mode notes about ops inside Functions; ``param_ids``/``leaf`` are the mode's own helpers."""

    def __init__(self, rec, follow, param_ids, leaf):
        self.rec = rec
        self.follow = follow
        self._param_ids = param_ids
        self._leaf = leaf
        self._pending: tuple | None = None  # (weakref to the forward's ctx or frame code, Pending)
        self._nested: set = set()  # (region, id(tensor)) already recorded

    def note(self, inputs, out, region: int | None) -> None:
        """An op inside a Function's forward took the grad-requiring ``inputs`` (``region``: reentrant checkpoint)."""
        rec = self.rec
        if region is not None:  # NOTE [parameters inside reentrant checkpoint]
            for t in inputs:
                while t.grad_fn is None and t._base is not None:
                    t = t._base  # a view taken in the body (under no_grad) of a parameter
                if t.grad_fn is None:
                    self._leaf(t, {}, rec.leaf_refs)
                    rec.checkpoint_params.setdefault(id(t), set()).add(region)
                elif (region, id(t)) not in self._nested:
                    self._checkpoint_input(t, region)
            return
        if isinstance(out, _Tensor) and out.is_floating_point():
            pending = self._function_call(inputs)
            if pending is not None:
                self.follow.track(out, pending)

    def _function_call(self, inputs) -> Pending | None:
        f: FrameType | None = sys._getframe(3)
        while f is not None and not is_function_forward(f.f_code):
            f = f.f_back
        if f is None:
            return None
        ctx = f.f_locals.get("ctx")
        last = self._pending
        if last is not None and last[0]() is not None and last[0]() is ctx:
            return last[1]
        try:
            ref = weakref.ref(ctx)
        except TypeError:  # forward without a ctx argument (setup_context style): one call per op
            ref = None
        parts = f.f_code.co_qualname.split(".")
        name = parts[-2] if len(parts) > 1 else "Function"
        location = frame_location(user_frame(f.f_back))
        del f
        pending = Pending(name, location, self._param_ids(inputs, self.rec.leaf_refs))
        if ref is not None:
            self._pending = (ref, pending)
        return pending

    def returned(self, pending: Pending, t) -> int | None:
        """The event of ``pending``, recorded now that its output ``t`` was used without a gradient (None: it
        has one)."""
        if t.requires_grad:
            return None
        if pending.index is None:
            extra = {"function": pending.function}
            pending.index = self.rec.record_event(
                "non-differentiable",
                f"{pending.function}.apply",
                pending.location,
                pending.params,
                peek_sequence_nr(),
                extra=extra,
            )
            self.rec.follow_event(pending.index)
        return pending.index

    def _checkpoint_input(self, t, region: int) -> None:
        self._nested.add((region, id(t)))
        frame, _ = checkpoint_region(sys._getframe(3))
        if frame is None:
            return
        args = frame.f_locals.get("args") or ()
        if any(a is t for a in args):
            return  # a top-level argument: the region differentiates it
        nested = _inside(args, t)
        location = frame_location(user_frame(frame.f_back))
        del frame
        params = self._param_ids([t], self.rec.leaf_refs)
        for p in params:
            self.rec.checkpoint_params.setdefault(p, set()).add(region)
        extra = {"region": region, "nested": nested}
        self.rec.record_event("checkpoint-input", "checkpoint", location, params, region, extra=extra)


def _inside(args, t) -> bool:
    """Whether ``t`` sits in a tuple, list, dict or dataclass among ``args`` (at most MAX_NESTED entries)."""
    stack, seen = list(args), 0
    while stack and seen < MAX_NESTED:
        a = stack.pop()
        seen += 1
        if a is t:
            return True
        if isinstance(a, (tuple, list)):
            stack.extend(a)
        elif isinstance(a, dict):
            stack.extend(a.values())
        elif dataclasses.is_dataclass(a) and not isinstance(a, type):
            stack.extend(getattr(a, f.name, None) for f in dataclasses.fields(a))
    return False
