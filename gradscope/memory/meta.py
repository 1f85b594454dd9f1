"""``gradscope.memory.cpu_kernels_on_meta()``: build on the ``meta`` device the graph CPU would build.

NOTE [meta graphs]
A forward on meta tensors builds the same autograd graph as on CPU for ordinary ops, so
``backward_memory()`` predicts the same bytes (tests/memory/test_backward_memory.py checks it). Fused kernels are
chosen by device, though: ``F.scaled_dot_product_attention`` on CPU runs the flash kernel
(``ScaledDotProductFlashAttentionForCpuBackward0``, which saves q, k, v, the output and a log-sum-exp),
while on meta it falls back to the math path that saves the whole attention matrix, so a meta prediction
of an attention model is too high. Inside this context, attention on meta tensors calls the CPU flash
kernel's own meta implementation instead, giving the CPU graph. Only the forward you run inside it is
affected, and only for meta tensors; everything else dispatches as usual.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cpu_kernels_on_meta"]

_SDPA = torch.nn.functional.scaled_dot_product_attention


class _MetaAsCPU(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            out = _flash(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def _flash(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The CPU flash kernel on meta tensors when CPU would pick it (no mask, same heads), else None."""
    if query.device.type != "meta" or attn_mask is not None or enable_gqa or query.dim() != 4:
        return None
    if key.shape[1] != query.shape[1] or query.dtype not in (
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float16,
    ):
        return None
    return torch._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, scale=scale)[0]


@contextlib.contextmanager
def cpu_kernels_on_meta():
    """Run a forward on meta tensors with the kernels CPU would choose (see NOTE [meta graphs]).

    Example:
        >>> with torch.device("meta"):                                  # doctest: +SKIP
        ...     model = GPT(); tokens = torch.randint(0, 50_000, (64, 1024))
        >>> with gradscope.memory.cpu_kernels_on_meta():                # doctest: +SKIP
        ...     loss = model(tokens).logsumexp(-1).mean()
        >>> gradscope.inspect(loss, model=model).backward_memory().peak # doctest: +SKIP
    """
    with _MetaAsCPU():
        yield
