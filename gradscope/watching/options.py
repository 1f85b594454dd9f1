"""The options of :func:`gradscope.watch`, checked once (:class:`WatchOptions`); choosing the parameters
it watches."""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from typing import Any

import torch

from gradscope._format import one_line
from gradscope._torchcheck import WALK, require
from gradscope._wrappers import unwrap_compiled, unwrap_parallel
from gradscope.errors import InputTypeError, InputValueError

__all__ = ["WatchOptions", "check_model", "select", "ignored"]


def _positive_int(name, value, zero=False):
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        raise InputValueError(f"{name} must be a {'non-negative' if zero else 'positive'} int, got {one_line(value)}.")


def check_model(model) -> None:
    """The one sentence for a ``model`` that is not an ``nn.Module``."""
    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(f"watch() needs a torch.nn.Module, got {type(model).__name__}: {one_line(model, 80)}.")
    require(*WALK, "engine-during-backward", "foreach-ops", "anomaly-mode")  # what watch() reads of torch


@dataclass(frozen=True, slots=True)
class WatchOptions:
    """The options of :func:`gradscope.watch` (see it for each), checked once when built.

    ``ignore`` is kept as a tuple of names or ``fnmatch`` patterns (one string becomes a 1-tuple); whether
    each pattern matches a parameter is checked against the model, in :func:`select`.

    Raises:
        InputValueError: a value out of range (one sentence naming the option and the value).
        InputTypeError: a value of the wrong type (``ignore``, ``scaler``, ``optimizer``).

    Example:
        >>> WatchOptions(every=2, ignore="head.*").text()
        "on_error='raise', every=2, ignore=['head.*']"
    """

    on_error: Any = "raise"
    check_nonfinite: bool = True
    ignore: Any = ()
    every: int = 1
    accumulate: int = 1
    scaler: Any = None
    graphs: bool = True
    history: int = 1000
    vanishing: float = 1e-7
    exploding: float = 1e3
    optimizer: Any = None
    ratio_every: int = 100
    find_origin: bool = True

    def __post_init__(self) -> None:
        on_error = self.on_error
        if not (on_error in ("raise", "warn") or callable(on_error)):
            raise InputValueError(
                f"on_error must be 'raise', 'warn' or a callable taking the findings, got {one_line(on_error)}."
            )
        for name in ("every", "accumulate", "ratio_every"):
            _positive_int(name, getattr(self, name))
        _positive_int("history", self.history, zero=True)
        for name in ("vanishing", "exploding"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise InputValueError(f"{name} must be a non-negative number, got {one_line(value)}.")
        scaler, optimizer = self.scaler, self.optimizer
        if scaler is not None and not (hasattr(scaler, "is_enabled") and hasattr(scaler, "get_scale")):
            raise InputTypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}.")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise InputTypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        object.__setattr__(self, "ignore", _patterns(self.ignore))

    @classmethod
    def of(cls, **options: Any) -> WatchOptions:
        """The options from keywords, an unknown keyword said in one sentence that lists the options.

        Raises:
            InputTypeError: a keyword that is not an option.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise InputTypeError(f"unknown watch option {one_line(unknown[0])}; the options are {', '.join(names)}.")
        return cls(**options)

    def text(self) -> str:
        """The options that differ from the defaults, for the guard's ``repr`` (``on_error`` always)."""
        on_error = self.on_error
        opts = [f"on_error={on_error!r}" if isinstance(on_error, str) else "on_error=<callable>"]
        if not self.check_nonfinite:
            opts.append("check_nonfinite=False")
        for name in ("every", "accumulate"):
            if getattr(self, name) != 1:
                opts.append(f"{name}={getattr(self, name)}")
        if self.ignore:
            opts.append(f"ignore={list(self.ignore)!r}")
        if self.scaler is not None:
            opts.append("scaler=GradScaler")
        if not self.graphs:
            opts.append("graphs=False")
        if self.optimizer is not None:
            opts.append(f"optimizer={type(self.optimizer).__name__}")
        return ", ".join(opts)


def _patterns(ignore) -> tuple[str, ...]:
    if not isinstance(ignore, (str, list, tuple, set, frozenset)):
        raise InputTypeError(f"ignore must be a name, a pattern or a list of them, got {type(ignore).__name__}.")
    patterns = (ignore,) if isinstance(ignore, str) else tuple(ignore)
    for pat in patterns:
        if not isinstance(pat, str):
            raise InputTypeError(f"ignore must hold parameter names or fnmatch patterns, got {one_line(pat)}.")
    return patterns


def ignored(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether ``ignore=`` names the parameter ``name`` (exactly or as an ``fnmatch`` pattern)."""
    return any(name == pat or fnmatch.fnmatchcase(name, pat) for pat in patterns)


def select(model, patterns: tuple[str, ...]):
    """``(inner module, is DDP, [(name, parameter)] to watch)`` for ``WatchOptions.ignore`` patterns."""
    model = unwrap_compiled(model)  # NOTE [torch.compile] in gradscope.watching.graphs
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    inner = unwrap_compiled(unwrap_parallel(model))
    named = list(inner.named_parameters())
    for pat in patterns:
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
    return inner, ddp, chosen
