"""Fresh CPU tensors laid out as a signature says, for running a node's backward again (NOTE [in-node
memory] in ``workspace.py``)."""

from __future__ import annotations

import torch

__all__ = ["Unmeasurable", "dtype_of", "make_tensor"]


class Unmeasurable(Exception):
    """This node's backward cannot be run again here; the message says why, in a user's words."""


def dtype_of(text: str) -> torch.dtype:
    """The torch dtype named ``text`` (``"float32"``)."""
    dt = getattr(torch, str(text), None)
    if not isinstance(dt, torch.dtype):
        raise Unmeasurable(f"unknown dtype {text!r}")
    return dt


#: Floats are one random block of this many values, repeated: drawing each value costs several times
#: what copying does, and no kernel's memory depends on values beyond that.
_TILE = 4096


def _tiled_uniform(flat: torch.Tensor) -> None:
    """Fill the 1-d ``flat`` with uniform values in [-1, 1): a random block of :data:`_TILE`, repeated."""
    n = flat.numel()
    k = min(n, _TILE)
    if k == 0:
        return
    block = torch.empty(k, dtype=flat.dtype).uniform_(-1, 1)
    whole = n - n % k
    flat[:whole].view(-1, k).copy_(block)
    flat[whole:].copy_(block[: n - whole])


def make_tensor(shape, dtype: str, stride=None, requires_grad: bool = False, bound: int = 1) -> torch.Tensor:
    """A fresh CPU tensor of this layout: uniform values for floats, integers in ``[0, bound)`` otherwise."""
    dt = dtype_of(dtype)
    shape = [int(n) for n in shape]
    t = torch.empty_strided(shape, stride, dtype=dt) if stride else torch.empty(shape, dtype=dt)
    flat = t.as_strided([t.untyped_storage().nbytes() // t.element_size()], [1])  # every element, once
    if dt.is_floating_point or dt.is_complex:
        _tiled_uniform(flat)
        return t.requires_grad_(requires_grad)
    if dt == torch.bool or bound <= 1:
        flat.zero_()
    else:
        flat.random_(0, bound)
    return t
