"""Run one training loop twice, unwatched and under ``gradscope.watch``, from the same seed."""

from __future__ import annotations

import torch

import gradscope


def snapshot(model):
    return [None if p.grad is None else (p.grad.to_dense() if p.grad.is_sparse else p.grad).detach().clone()
            for p in model.parameters()]


def twin(build, step, steps=3, **options):
    """``build() -> (model, opt)``; ``step(model, opt, i)`` runs step ``i``. Runs the loop without gradscope
    and under ``watch(model, on_error="raise", **options)``, asserts that every step's gradients and the final
    weights are bit-identical, and returns the (removed) guard."""
    runs = []
    guard = None
    for watched in (False, True):
        torch.manual_seed(0)
        model, opt = build()
        if watched:
            guard = gradscope.watch(model, on_error="raise", **options)
        grads = []
        try:
            for i in range(steps):
                step(model, opt, i)
                grads.append(snapshot(model))
        finally:
            if guard is not None:
                guard.remove()
        runs.append((grads, [p.detach().clone() for p in model.parameters()]))
    (g0, w0), (g1, w1) = runs
    assert len(g0) == len(g1) == steps
    for a, b in zip(g0, g1):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
    assert all(torch.equal(x, y) for x, y in zip(w0, w1))
    return guard
