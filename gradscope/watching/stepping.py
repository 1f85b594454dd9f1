"""``none-grad`` and ``not-optimized`` judged at ``optimizer.step()`` (NOTE [judged at the step]).

NOTE [judged at the step]
What a user means by "this parameter got no gradient" is: when the optimizer steps, it holds a
parameter that no backward since its previous step reached. One step may run several backwards: a GAN
whose generator and discriminator live in one module (the discriminator's backward reaches no generator
parameter), one loss per task (``loss1.backward(retain_graph=True); loss2.backward()``), gradient
accumulation. So once an optimizer that holds a watched parameter is known, the guard judges there.
torch's global ``torch.optim.optimizer.register_optimizer_step_pre_hook`` sees every optimizer's
``step()`` without the user passing one (one hook per guard, removed with it; an optimizer holding none
of the watched parameters is ignored). Each optimizer keeps a *floor*: one more than the largest graph
task id any watched parameter had received at its previous step (graph task ids only grow, NOTE [end of
backward] in :mod:`gradscope.watching.guard`); at its step, a held parameter whose stamp is below the
floor received nothing since. A ``step(closure)`` (LBFGS) runs its backwards inside the step, so it is
judged in the post hook instead.

An optimizer is known once one has stepped, or earlier: the first time a backward leaves a parameter
without gradient, before saying so, the guard looks once through the objects Python's garbage collector
tracks for an optimizer holding a watched parameter (a one-time scan, on that path only). Without one the
backward is judged on its own, as before. Consequence: with an optimizer, a ``none-grad`` error under
``on_error="raise"`` comes out of ``optimizer.step()``, before the update, instead of ``backward()``.

NOTE [gradients set by hand]
Not every ``.grad`` comes from a backward through the model: ``torch.func.grad``/``vmap`` per-sample
gradients, federated averaging or evolution strategies assign ``p.grad = g`` and step. A held parameter
that no watched backward reached but whose ``.grad`` was set by hand since the previous step received
one: its ``.grad`` is another tensor object than at that step (a weak reference is kept, only on steps
that found such parameters, so a healthy step pays nothing), or, the first time, it holds a ``.grad``
although no watched backward ever reached it. A stale ``.grad`` (the same tensor, zeroed in place by
``zero_grad(set_to_none=False)``) is still missing. Limit: a gradient written in place into the old
``.grad`` (``p.grad.copy_(g)``) cannot be told from a stale one and is reported.

NOTE [unfrozen later]
torch refuses a hook on a tensor that does not require grad, so a parameter frozen when ``watch()``
starts is not watched. Each optimizer's record lists the tensors it holds that are frozen (read again
when its parameters change); at its step, one C-level pass over that list (nothing when none is frozen)
sees a parameter unfrozen since (``requires_grad_(True)``, an unfreezing schedule), and the model's
parameters are read again at once: it is judged at that step (no gradient since it was unfrozen:
``none-grad``) and watched from then on.

``not-optimized``: from an optimizer's second step on, a watched parameter that received a gradient since
that optimizer's previous step but that no optimizer seen stepping holds (created or replaced after the
optimizer was built) is never updated. The model's parameters are read again on that second step, every
100 steps, and when a held parameter got no gradient, so a layer replaced after ``watch()`` is found too.
"""

from __future__ import annotations

import gc
import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from gradscope._torch import peek_sequence_nr
from gradscope.findings import NOT_OPTIMIZED, WARNING, Finding, sort_findings
from gradscope.watching.step import error_message, none_grad_findings, rank_text, where_text

__all__ = ["StepJudge", "StepVerdict", "step_report"]

_RESCAN_EVERY = 100
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class StepVerdict:
    """What one optimizer step found (plain data for the guard to word and deliver)."""

    __slots__ = ("optimizer", "step", "backwards", "missing", "unheld", "replaced")

    def __init__(self, optimizer: str, step: int, backwards: int, missing: list[int], unheld: list[int]):
        self.optimizer, self.step, self.backwards = optimizer, step, backwards
        self.missing, self.unheld = missing, unheld
        self.replaced: list[str] = []  # parameters found new when the model was read again (since watch())


def _closure(args: tuple, kwargs: dict) -> Any:
    return args[1] if len(args) > 1 else kwargs.get("closure")


class StepJudge:
    """One guard's view of the optimizer steps (NOTE [judged at the step])."""

    def __init__(self, guard: Any, safety: Any, verdict: Callable[[StepVerdict], None], after: Callable[[int], None]):
        self._guard = guard  # reads _params, _stamp, _param_ids, backwards; calls _rescan
        self._verdict, self._after = verdict, after
        self.boundary: int | None = None  # NOTE [carried state]: the smallest of the optimizers' last steps
        self.known = False  # an optimizer holding a watched parameter is known
        self._looked = False
        self._added: set[str] = set()  # parameters found new when the model was read again
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> _Seen
        self._records: list[_Seen] = []  # the same records, in a plain list (read on every step)
        self._handles = [
            register_optimizer_step_pre_hook(lambda *a: safety.run("optimizer step", self._pre, *a)),
            register_optimizer_step_post_hook(  # only a step(closure) is judged after the step
                lambda opt, args, kwargs: (
                    None if _closure(args, kwargs) is None else safety.run("optimizer step", self._judge, opt)
                )
            ),
        ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._records = [], []
        self._seen = weakref.WeakKeyDictionary()  # their frozen tensors: a removed guard keeps none alive

    # -- which parameters an optimizer holds ---------------------------------------------------------
    def _indices(self, opt: torch.optim.Optimizer, seen: _Seen | None = None) -> set[int]:
        """The watched parameters ``opt`` holds, cached while neither side changes."""
        guard = self._guard
        key = (guard._changes, sum(len(group["params"]) for group in opt.param_groups))
        if seen is not None and seen.key == key:
            return seen.held
        ids, index = guard._param_ids, guard._index
        out, frozen = set(), []
        for group in opt.param_groups:
            for p in group["params"]:
                name = ids.get(id(p))
                if name is not None:
                    out.add(index[name])
                elif not p.requires_grad:
                    frozen.append(p)
        if seen is not None:
            seen.key, seen.frozen = key, frozen
        return out

    def discover(self) -> bool:
        """Whether some live optimizer holds a watched parameter (one scan per guard; see the NOTE)."""
        if self.known or self._looked:
            return self.known
        self._looked = True
        ids = self._guard._param_ids
        optimizer = torch.optim.Optimizer
        for obj in gc.get_objects():
            if issubclass(type(obj), optimizer):  # type(), not isinstance: no __class__ property runs
                if any(id(p) in ids for group in obj.param_groups for p in group["params"]):
                    self.known = True
                    break
        return self.known

    # -- the hooks -----------------------------------------------------------------------------------
    def _pre(self, opt, args, kwargs) -> None:
        if _closure(args, kwargs) is None:
            self._judge(opt)

    def _judge(self, opt) -> None:
        seen = self._seen.get(opt)
        if seen is None:  # remembered even when it holds none of ours, so that its next steps cost one lookup
            seen = self._seen[opt] = _Seen(opt)
        held = self._indices(opt, seen)
        if not held:
            return  # another model's optimizer
        self.known = True
        guard = self._guard
        if not seen.ours:
            seen.ours = True
            self._records.append(seen)
        seen.steps += 1
        step, floor = seen.steps, seen.floor
        backwards, seen.backwards = guard.backwards - seen.backwards, guard.backwards
        stamps, params = guard._stamp, guard._params
        missing: list[int] = []
        if min(map(stamps.__getitem__, held)) < floor:  # one C-level pass when every held one received
            missing = sorted(i for i in held if stamps[i] < floor and params[i].param.requires_grad)
            missing = _not_assigned(seen, missing, params, stamps) if missing else missing
        unfrozen = seen.frozen and any(map(_REQUIRES_GRAD, seen.frozen))  # NOTE [unfrozen later]
        if step == 2 or missing or unfrozen or not step % _RESCAN_EVERY:
            if unfrozen:
                seen.key = ()  # read which of its parameters are frozen again on the next step
            replaced = guard._rescan()
            self._added.update(replaced)
            if replaced:  # held again: dropped ones leave, unfrozen ones come in (judged at this step)
                held = self._indices(opt, seen)
                stamps, params = guard._stamp, guard._params
                missing = sorted(i for i in held if stamps[i] < floor and params[i].param.requires_grad)
                missing = _not_assigned(seen, missing, params, stamps) if missing else missing
        seen.held, seen.floor = held, max(stamps, default=-1) + 1
        unheld: list[int] = []
        if step >= 2 and len(held) < len(stamps):  # an optimizer holding every watched one leaves none unheld
            unheld = [i for i, s in enumerate(stamps) if s >= floor and i not in held]
            if unheld:  # held by no optimizer seen stepping?
                everyone = set().union(*(x.held for x in self._records))
                unheld = [i for i in unheld if i not in everyone and params[i].param.requires_grad]
        seen.mark = peek_sequence_nr()
        self._records = [x for x in self._records if x.opt() is not None]  # optimizers still alive
        self.boundary = min(x.mark for x in self._records)
        self._after(self.boundary)
        if missing or unheld:
            verdict = StepVerdict(type(opt).__name__, step, backwards, missing, unheld)
            verdict.replaced = sorted(self._added)
            self._verdict(verdict)


class _Seen:
    """What a guard remembers of one optimizer (NOTE [judged at the step])."""

    __slots__ = ("opt", "steps", "floor", "backwards", "held", "mark", "key", "ours", "grads", "frozen")

    def __init__(self, opt) -> None:
        self.opt = weakref.ref(opt)
        self.ours = False  # holds a watched parameter (in the guard's list of records)
        self.steps = self.floor = self.backwards = self.mark = 0
        self.held: set[int] = set()
        self.key: tuple = ()
        self.grads: dict[int, weakref.ref] = {}  # NOTE [gradients set by hand]
        self.frozen: list = []  # the tensors it holds that no guard hook is on: requires_grad=False


def _not_assigned(seen: _Seen, missing: list[int], params: list, stamps: list[int]) -> list[int]:
    """``missing`` less the parameters whose ``.grad`` was set by hand since the previous step
    (NOTE [gradients set by hand])."""
    out, now = [], {}
    for i in missing:
        grad = params[i].param.grad
        if grad is None:
            out.append(i)
            continue
        before, now[i] = seen.grads.get(i), weakref.ref(grad)
        if before is None and stamps[i] < 0:
            continue  # never reached by a watched backward, yet it holds a .grad: set by hand
        if before is not None and before() is not grad:
            continue  # another tensor than at the previous step: set by hand
        out.append(i)  # the .grad the previous step left (zero_grad(set_to_none=False)): stale
    seen.grads = now
    return out


def _unheld_finding(wp, v: StepVerdict) -> Finding:
    new = (
        " It is not the parameter that was there when the optimizer was built: the model was read again "
        "and this one is new (a layer or parameter replaced after the optimizer was built leaves the "
        "optimizer holding the old one)."
        if wp.name in v.replaced
        else ""
    )
    return Finding(
        NOT_OPTIMIZED,
        WARNING,
        f"Parameter {wp.name!r} ({where_text(wp)}) receives gradients, but no optimizer that steps holds it "
        f"(checked at step {v.step} of {v.optimizer}), so its .grad is never applied.{new} Fix: build the "
        f"optimizer after the model is final, or add it with optimizer.add_param_group({{'params': [...]}}); "
        f"if it is meant to stay fixed, call requires_grad_(False) on it.",
        params=(wp.name,),
    )


def step_report(missing: list, unheld: list, v: StepVerdict, ddp_strict: bool, causes=None) -> tuple:
    """``(findings, message, quiet message)`` of one optimizer step (NOTE [judged at the step])."""
    rank = rank_text()
    ran = (
        f"in the {v.backwards} backward{'s' if v.backwards != 1 else ''} through the model"
        if v.backwards
        else "(no backward through the model ran)"
    )
    held = f", yet {v.optimizer} holds it and is about to step"
    context = f"{ran} since the previous step of {v.optimizer} (checked at its step {v.step}" + (
        f", {rank})" if rank else ")"
    )
    stable = f"between two steps of {v.optimizer}" + (f" ({rank})" if rank else "")
    findings = sort_findings(
        none_grad_findings(missing, context + held, ddp_strict, causes=causes)
        + [_unheld_finding(wp, v) for wp in unheld]
    )
    warned = "".join(f"\n- {f.kind} ({f.severity}): {f.message}" for f in findings if f.severity == WARNING)
    message = error_message(missing, [], context, ddp_strict, None, causes=causes) if missing else None
    quiet = error_message(missing, [], stable, ddp_strict, None, causes=causes) if missing else "gradscope.watch:"
    quiet += warned
    return findings, message, quiet
