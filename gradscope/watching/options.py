"""Checking the arguments of :func:`gradscope.watch` and choosing the parameters it watches."""

from __future__ import annotations

import fnmatch

import torch

from gradscope._format import one_line
from gradscope._torchcheck import WALK, require
from gradscope._wrappers import unwrap_compiled, unwrap_parallel
from gradscope.errors import InputTypeError, InputValueError

__all__ = ["validate", "select", "ignored"]


def _positive_int(name, value, zero=False):
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        raise InputValueError(f"{name} must be a {'non-negative' if zero else 'positive'} int, got {one_line(value)}.")


def validate(model, on_error, every, accumulate, history, ratio_every, vanishing, exploding, scaler, optimizer) -> None:
    """One clear sentence in our exception types for each bad argument."""
    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(f"watch() needs a torch.nn.Module, got {type(model).__name__}: {one_line(model, 80)}.")
    require(*WALK, "engine-during-backward", "foreach-ops", "anomaly-mode")  # what watch() reads of torch
    if not (on_error in ("raise", "warn") or callable(on_error)):
        raise InputValueError(
            f"on_error must be 'raise', 'warn' or a callable taking the findings, got {one_line(on_error)}."
        )
    _positive_int("every", every)
    _positive_int("accumulate", accumulate)
    _positive_int("history", history, zero=True)
    _positive_int("ratio_every", ratio_every)
    for name, value in (("vanishing", vanishing), ("exploding", exploding)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise InputValueError(f"{name} must be a non-negative number, got {one_line(value)}.")
    if scaler is not None and not (hasattr(scaler, "is_enabled") and hasattr(scaler, "get_scale")):
        raise InputTypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}.")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise InputTypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")


def ignored(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether ``ignore=`` names the parameter ``name`` (exactly or as an ``fnmatch`` pattern)."""
    return any(name == pat or fnmatch.fnmatchcase(name, pat) for pat in patterns)


def select(model, ignore):
    """``(inner module, is DDP, [(name, parameter)] to watch, ignore patterns)``."""
    if not isinstance(ignore, (str, list, tuple, set, frozenset)):
        raise InputTypeError(f"ignore must be a name, a pattern or a list of them, got {type(ignore).__name__}.")
    patterns = (ignore,) if isinstance(ignore, str) else tuple(ignore)
    model = unwrap_compiled(model)  # NOTE [torch.compile] in gradscope.watching.graphs
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    inner = unwrap_compiled(unwrap_parallel(model))
    named = list(inner.named_parameters())
    for pat in patterns:
        if not isinstance(pat, str):
            raise InputTypeError(f"ignore must hold parameter names or fnmatch patterns, got {one_line(pat)}.")
        if not any(ignored(n, (pat,)) for n, _ in named):
            example = named[0][0] if named else "(none)"
            raise InputValueError(
                f"ignore pattern {pat!r} matches no parameter of the model; its parameters are named like {example!r}."
            )
    chosen = [(n, p) for n, p in named if p.requires_grad and not ignored(n, patterns)]
    for n, p in chosen:
        if not p.is_leaf:
            raise InputValueError(
                f"Parameter {n!r} is not a leaf tensor (its grad_fn is {type(p.grad_fn).__name__}): it was "
                f"written by an op that requires grad (an in-place write such as `p[0] = x` with x "
                f"requiring grad), so torch never stores a .grad in it. Write it under torch.no_grad(), "
                f"or pass watch(model, ignore=[{n!r}])."
            )
    return inner, ddp, chosen, patterns
