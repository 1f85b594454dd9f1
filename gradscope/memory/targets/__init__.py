"""Device targets (NOTE [device targets]): how the replay's bytes become a device's memory and which kernels
that device picks. ``resolve("cpu" | "cuda" | Target)`` gives the target a ``target=`` argument names."""

from __future__ import annotations

from gradscope._format import one_line
from gradscope.errors import InputTypeError, InputValueError
from gradscope.memory.targets.base import EFFICIENT, FLASH, MATH, Target
from gradscope.memory.targets.cpu import CPU
from gradscope.memory.targets.cuda import CUDA

__all__ = ["Target", "CPU", "CUDA", "resolve", "MATH", "FLASH", "EFFICIENT", "NAMES"]

#: The names ``target=`` and ``--target`` take.
NAMES = {"cpu": CPU, "cuda": CUDA}


def resolve(target) -> Target:
    """The :class:`Target` that ``target`` names: None or ``"cpu"`` (the default), ``"cuda"``, or a Target.

    Raises:
        InputValueError: an unknown name. InputTypeError: neither a name nor a Target.
    """
    if target is None:
        return CPU()
    if isinstance(target, Target):
        return target
    if isinstance(target, str):
        cls = NAMES.get(target.strip().lower())
        if cls is None:
            raise InputValueError(f"target= takes 'cpu' or 'cuda' (or a gradscope Target), got {one_line(target)}.")
        return cls()
    raise InputTypeError(f"target= takes 'cpu' or 'cuda' (or a gradscope Target), got a {type(target).__name__}.")
