"""``gradscope.memory.kernels_on_meta(target)``: build on the ``meta`` device the graph the target device would.

NOTE [meta graphs]
A forward on meta tensors builds the same autograd graph as on CPU for ordinary ops, so ``backward_memory()``
predicts the same bytes (tests/memory/test_meta_equals_cpu.py checks it against the same model on CPU). Fused
kernels are chosen by device, though, and ``meta`` always answers "math" for
``F.scaled_dot_product_attention``: the composite path that saves the whole attention matrix. CPU runs its
flash kernel (``ScaledDotProductFlashAttentionForCpuBackward0``: q, k, v, the output, a log-sum-exp and the
mask) for every call without dropout, masks of either kind and grouped-query heads included, and the math
path as soon as ``dropout_p > 0``; CUDA has flash and memory-efficient kernels with their own rules. Inside
this context each attention call on meta tensors asks the target which kernel the device would run
(:meth:`Target.sdpa_backend`: for CPU, torch's own ``_fused_sdp_choice`` on CPU stand-ins) and calls that
kernel's meta implementation, with the conversions torch makes around it (a boolean mask turned additive;
on CUDA, the head size padded to a multiple of 8 for flash and the mask's last dimension to 16 for the
memory-efficient kernel). Only calls on meta tensors inside the context change; everything else dispatches
as usual. ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, ``nn.TransformerEncoder``) calls
attention inside itself, where a mode handling the outer call does not see it: on meta tensors its body
runs with the mode active (:func:`without_torch_function_check`). Convolution keeps the layout on CPU:
its output (and in backward its input and weight gradients) is channels-last when the input or the weight
is, for 2-d convolutions of every dtype and for 3-d ones that oneDNN runs (float32 / bfloat16), contiguous
otherwise and for 1-d; meta's convolution always returns a contiguous output (and channels-last gradients
from either). With the target ``"cpu"``, the context holds a dispatch mode that gives each convolution on
meta tensors, forward and backward, CPU's strides (:func:`cpu_conv_format`), so the next ops see the layout
CPU gives them; that mode sees every op, so it is entered at the first convolution on meta tensors (a
model without one, a transformer, runs without it). Other ops whose CPU kernel depends on layout or flags
(``max_pool``) build the same nodes with the same saved shapes on meta. Recurrent layers do not: CPU runs
oneDNN's RNN layer for ``nn.LSTM`` and computes the input projections of every step at once for ``nn.GRU``
/ ``nn.RNN``, CUDA runs cuDNN, meta the cell-by-cell path; inside this context such a call on meta tensors
raises :class:`~gradscope.errors.InputValueError` naming the layer, rather than answer for another graph.
(Meta's own ``mkldnn_rnn_layer`` builds CPU's LSTM node but saves an empty workspace where oneDNN saves one
whose size only its primitive knows, so routing the LSTM there would match the names and not the bytes.)
Measured on torch 2.13 (tests/memory/test_meta_equals_cpu.py): the ops that differ are these and
``F.embedding_bag`` (its ``max_indices`` has one entry per bag on CPU and none on meta: 8 bytes a bag).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from gradscope._torch import cpu_flash_attention
from gradscope.errors import InputValueError
from gradscope.memory.targets import EFFICIENT, FLASH, Target, resolve

__all__ = ["kernels_on_meta", "cpu_kernels_on_meta"]

_SDPA = F.scaled_dot_product_attention


def without_torch_function_check(func: Any) -> Any:
    """A copy of the Python function ``func`` (``F.multi_head_attention_forward``) whose own
    ``has_torch_function`` check answers False, so that a TorchFunctionMode handling ``func`` can run its body
    with the mode active and see the torch calls inside it (a mode is popped while it handles a call, and
    re-pushed it would receive ``func`` again). Nothing of torch changes: the copy has its own globals.
    docs/internals.md#attention-kernel-choice."""
    scope = dict(func.__globals__, has_torch_function=lambda *_: False)
    out = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
    out.__kwdefaults__ = func.__kwdefaults__
    return out


#: torch's Python functions that call attention inside: run with the mode active (NOTE [meta graphs]).
_CALLS_SDPA = {F.multi_head_attention_forward: without_torch_function_check(F.multi_head_attention_forward)}
#: The recurrent kernels (``torch._VF``) whose meta graph is not the device's, with the layer that calls each.
_RNN = {torch._VF.lstm: "nn.LSTM", torch._VF.gru: "nn.GRU", torch._VF.rnn_tanh: "nn.RNN", torch._VF.rnn_relu: "nn.RNN"}
_CL = {4: torch.channels_last, 5: torch.channels_last_3d}
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


#: The torch functions that run ``aten.convolution``: the first one on meta tensors turns on the CPU strides.
_CONVS = frozenset(
    {torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d}
    | {torch.conv_transpose3d, torch.convolution, torch._convolution}
)


class _MetaAs(TorchFunctionMode):
    def __init__(self, target: Target, strides: contextlib.ExitStack | None = None):
        super().__init__()
        self.target = target
        self.strides = strides  # enters _CpuConvStrides at the first convolution on meta tensors

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.strides is not None and func in _CONVS and _on_meta(args[:2]):
            self.strides.enter_context(_CpuConvStrides())  # from here on, until the context ends
            self.strides = None
        layer = _RNN.get(func)
        if layer is not None and _on_meta(args[:1]):
            raise InputValueError(
                f"{layer} builds a different graph on meta than on {self.target.name} (the cell-by-cell path "
                f"instead of the {self.target.name} kernel), so its memory cannot be asked from the meta "
                "device: build the model on the CPU with the real shapes, or run the forward outside "
                "kernels_on_meta() to accept the meta graph's answer."
            )
        inner = _CALLS_SDPA.get(func)
        if inner is not None and _on_meta(args):
            with self:  # nn.MultiheadAttention's sdpa path: the attention call inside is this mode's too
                return inner(*args, **kwargs)
        if func is _SDPA:
            call = dict(zip(_NAMES, args), **kwargs)
            q = call.get("query")
            if isinstance(q, torch.Tensor) and q.device.type == "meta":
                out = _attention(self.target, call)
                if out is not None:
                    return out
        return func(*args, **kwargs)


def _on_meta(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in args)


def cpu_conv_format(input: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """The memory format of CPU's convolution output and gradients for this input and weight (torch 2.13,
    docs/internals.md#convolution-layout-on-cpu): channels-last when either is, for 2-d convolutions and for
    3-d ones run by oneDNN (float32 / bfloat16, oneDNN enabled); contiguous otherwise."""
    cl = _CL.get(input.dim())
    if cl is None:
        return torch.contiguous_format
    if cl is torch.channels_last_3d and not (
        torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
        and input.dtype in (torch.float32, torch.bfloat16)
    ):
        return torch.contiguous_format
    return cl if _channels_last(input) or _channels_last(weight) else torch.contiguous_format


def _channels_last(t: torch.Tensor) -> bool:
    """Whether torch's ``suggest_memory_format`` says channels-last: strides ordered N, spatial..., C and
    not also contiguous (a tensor that is both, one channel or 1 x 1 spatial, counts as contiguous)."""
    if t.is_contiguous():
        return False
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: (-strides[d], d))
    return order == [0, *range(2, t.dim()), 1]


def _like(t: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
    """A meta tensor of ``t``'s shape and dtype in the memory format ``fmt``."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device, memory_format=fmt)


class _CpuConvStrides(TorchDispatchMode):
    """Convolution on meta tensors, below autograd: the output and gradients in CPU's memory format."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.convolution.default and out.device.type == "meta":
            return _like(out, cpu_conv_format(args[0], args[1]))
        if func is torch.ops.aten.convolution_backward.default and args[1].device.type == "meta":
            fmt = cpu_conv_format(args[1], args[2])
            return tuple(_like(t, fmt) if t is not None and i < 2 else t for i, t in enumerate(out))
        return out


def _attention(target: Target, call: dict):
    """The target's attention kernel on meta tensors, or None for the math path (meta's own)."""
    try:
        backend = target.sdpa_backend(**call)
    except TypeError:  # an argument this torch does not know: leave the call to torch
        return None
    if backend == FLASH and target.name == "cpu":
        return cpu_flash_attention(**call)
    if backend == FLASH:
        return _cuda_flash(**call)
    if backend == EFFICIENT:
        return _cuda_efficient(**call)
    return None


def _cuda_flash(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """CUDA's flash kernel on meta tensors: the head size padded to a multiple of 8 first, as torch does."""
    d = query.shape[-1]
    pad = -d % 8
    if scale is None:
        scale = d**-0.5
    if pad:
        query, key, value = (F.pad(t, (0, pad)) for t in (query, key, value))
    op = torch.ops.aten._scaled_dot_product_flash_attention
    out = op(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    return out[..., :d] if pad else out


def _cuda_efficient(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """CUDA's memory-efficient kernel on meta tensors: a boolean mask made additive and its last dimension
    padded to a multiple of 16 (then sliced back and expanded), as torch does."""
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.where(attn_mask.logical_not(), float("-inf"), 0.0).to(query.dtype)
        n = attn_mask.shape[-1]
        if n % 16:
            attn_mask = F.pad(attn_mask, (0, -n % 16))[..., :n]
        b, h, lq = query.shape[0], query.shape[1], query.shape[2]
        attn_mask = attn_mask.expand(b, h, lq, key.shape[2])
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    op = torch.ops.aten._scaled_dot_product_efficient_attention
    return op(query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale)[0]


@contextlib.contextmanager
def kernels_on_meta(target="cpu"):
    """Run a forward on meta tensors with the kernels ``target`` would choose (see NOTE [meta graphs]).

    Args:
        target: ``"cpu"`` (default), ``"cuda"`` or a :class:`gradscope.memory.targets.Target`; pass the same
            target to ``backward_memory(target=...)``.

    Example:
        >>> with torch.device("meta"):                                  # doctest: +SKIP
        ...     model = GPT(); tokens = torch.randint(0, 50_000, (64, 1024))
        >>> with gradscope.memory.kernels_on_meta("cuda"):              # doctest: +SKIP
        ...     loss = model(tokens).logsumexp(-1).mean()
        >>> gradscope.inspect(loss, model=model).backward_memory(target="cuda").peak  # doctest: +SKIP
    """
    target = resolve(target)
    with contextlib.ExitStack() as stack:  # the dispatch mode only once a convolution needs it (every op
        stack.enter_context(_MetaAs(target, stack if target.name == "cpu" else None))  # pays for one)
        yield


def cpu_kernels_on_meta():
    """``kernels_on_meta("cpu")``: a forward on meta tensors builds the graph CPU would (NOTE [meta graphs])."""
    return kernels_on_meta("cpu")
