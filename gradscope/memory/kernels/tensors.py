"""Fresh CPU tensors for rebuilding a node's backward (``rebuild.py``), and the scalar that sends a gradient.

NOTE [in-node memory] in ``workspace.py``.
"""

from __future__ import annotations

import torch

__all__ = ["Unmeasurable", "make_tensor", "root", "torch_dtype"]


class Unmeasurable(Exception):
    """This node's backward cannot be run again here; the message says why, in a user's words."""


def torch_dtype(text: str) -> torch.dtype:
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
    dt = torch_dtype(dtype)
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


class _Sends(torch.autograd.Function):
    """A scalar whose backward sends its input the gradient ``g`` it was given, strides and all."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return ctx.g, None


def root(out: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A scalar whose backward sends ``out`` a gradient laid out as ``g`` (see ``_builtin``'s ``run``)."""
    if g.dim() and not any(g.stride()):
        return out.sum()
    if g.untyped_storage().nbytes() > g.numel() * g.element_size():  # gaps: TensorIterator would close them
        return _Sends.apply(out, g)
    return (out * g).sum()
