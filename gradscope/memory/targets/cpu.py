"""The CPU target: c10's CPU allocator counts what each tensor asks for; attention follows torch's own choice.

``torch._fused_sdp_choice`` answers which kernel CPU runs for an ``F.scaled_dot_product_attention`` call
(docs/internals.md#attention-kernel-choice): flash (``_scaled_dot_product_flash_attention_for_cpu``) unless
dropout is above zero, a tensor is not 4-d, the head sizes differ, ... For ``meta`` tensors it always answers
math, so the question is asked on CPU stand-ins that share every property the choice reads (shape, the last
stride, dtype, ``requires_grad``) and point at one tiny buffer, so asking allocates almost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradscope._torch import sdp_choice
from gradscope._torchcheck import require
from gradscope.memory.targets.base import FLASH, MATH, Target

__all__ = ["CPU", "cpu_stand_in"]


def cpu_stand_in(t):
    """A CPU tensor with ``t``'s shape, dtype, last stride and ``requires_grad`` over a buffer of at most one
    row (every other stride 0); ``t`` itself when it is not a tensor or already on CPU."""
    if not isinstance(t, torch.Tensor) or t.device.type == "cpu":
        return t
    shape = tuple(t.shape)
    last = t.stride(-1) if t.dim() else 1
    n = (shape[-1] - 1) * last + 1 if shape and shape[-1] > 0 else 1
    base = torch.empty(max(n, 1), dtype=t.dtype)
    strides = (0,) * (len(shape) - 1) + ((last,) if shape else ())
    out = base.as_strided(shape, strides)
    return out.requires_grad_() if t.requires_grad and t.dtype.is_floating_point else out


@dataclass(frozen=True)
class CPU(Target):
    """The CPU: bytes as asked, attention as ``torch._fused_sdp_choice`` picks it on CPU (measured: the
    tests compare against torch.profiler on CPU)."""

    name: str = "cpu"
    measured: bool = True

    def sdpa_backend(
        self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ) -> str:
        require("attention-kernel")
        args = [cpu_stand_in(t) for t in (query, key, value, attn_mask)]
        kwargs = {"dropout_p": dropout_p, "is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa}
        return FLASH if sdp_choice(args, kwargs) == 1 else MATH

    def __repr__(self) -> str:
        return "CPU()"
