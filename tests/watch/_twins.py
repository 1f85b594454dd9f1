"""Run one training loop twice, unwatched and under ``gradscope.watch``, from the same seed.

The unwatched run is torch's truth of "healthy": at every ``optimizer.step()`` (caught by torch's global
step hooks), each parameter the optimizer holds that requires grad has a ``.grad`` that is set and finite.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import gradscope


def snapshot(model):
    return [None if p.grad is None else (p.grad.to_dense() if p.grad.is_sparse else p.grad).detach().clone()
            for p in model.parameters()]


def _closure(args, kwargs):
    return args[1] if len(args) > 1 else kwargs.get("closure")


def _unhealthy(opt) -> list:
    """The held parameters that require grad whose ``.grad`` is None or not finite (torch's view)."""
    bad = []
    for g, group in enumerate(opt.param_groups):
        for j, p in enumerate(group["params"]):
            if not p.requires_grad:
                continue
            grad = p.grad
            if grad is None:
                bad.append((g, j, "None"))
            elif not torch.isfinite(grad.coalesce().values() if grad.is_sparse else grad).all():
                bad.append((g, j, "non-finite"))
    return bad


class StepTruth:
    """Counts the optimizer steps of the unwatched run and records any unhealthy one; a ``step(closure)``
    (LBFGS) is read after the step, when its backwards have run."""

    def __init__(self):
        self.steps, self.bad = 0, []
        self._handles = [
            register_optimizer_step_pre_hook(lambda o, a, k: None if _closure(a, k) else self._read(o)),
            register_optimizer_step_post_hook(lambda o, a, k: self._read(o) if _closure(a, k) else None),
        ]

    def _read(self, opt) -> None:
        self.steps += 1
        bad = _unhealthy(opt)
        if bad:
            self.bad.append((self.steps, type(opt).__name__, bad))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def twin(build, step, steps=3, healthy=True, **options):
    """``build() -> (model, opt)``; ``step(model, opt, i)`` runs step ``i``. Runs the loop without gradscope
    and under ``watch(model, on_error="raise", **options)``, asserts that every step's gradients and the final
    weights are bit-identical, and, with ``healthy``, that torch found every optimizer step healthy (module
    docstring); returns the (removed) guard, with ``guard.truth_steps`` the optimizer steps torch saw."""
    runs = []
    guard = truth = None
    for watched in (False, True):
        torch.manual_seed(0)
        model, opt = build()
        if watched:
            guard = gradscope.watch(model, on_error="raise", **options)
        else:
            truth = StepTruth()
        grads = []
        try:
            for i in range(steps):
                step(model, opt, i)
                grads.append(snapshot(model))
        finally:
            (guard if watched else truth).remove()
        runs.append((grads, [p.detach().clone() for p in model.parameters()]))
    if healthy:
        assert not truth.bad, f"torch's run is not healthy (step, optimizer, [(group, index, grad)]): {truth.bad}"
    (g0, w0), (g1, w1) = runs
    assert len(g0) == len(g1) == steps
    for a, b in zip(g0, g1):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
    assert all(torch.equal(x, y) for x, y in zip(w0, w1))
    guard.truth_steps = truth.steps
    return guard
