"""The CUDA target, modelled from torch's source and not measured on a GPU here.

NOTE [CUDA caching allocator]
``torch.cuda.memory_allocated()`` counts the blocks of ``c10/cuda/CUDACachingAllocator.cpp``, not the bytes
asked for. The rules it follows (torch 2.13, default configuration: no ``max_split_size_mb``, no
``roundup_power2_divisions``, no expandable segments):

- every request is rounded up to a multiple of 512 bytes, and at least 512 (an empty tensor takes no block);
- a rounded request of at most 1 MiB is served from the small pool, whose segments are 2 MiB; a larger one
  from the large pool, whose new segments are 20 MiB for requests under 10 MiB and the request rounded up
  to 2 MiB from 10 MiB on;
- a free block bigger than the request is split when what remains is at least 512 bytes (small pool) or
  more than 1 MiB (large pool); otherwise the whole block is handed out and counted as allocated.

So a request of 10 MiB or more that gets a new segment counts the segment whole when the 2 MiB rounding
leaves 1 MiB or less (:meth:`CUDA.allocated`). A large request served from a cached free block may be
counted with up to 1 MiB more (an unsplit remainder): that depends on which blocks are free at that
moment and is not modelled (:attr:`CUDA.unmodelled`). ``reserved()`` estimates the segments behind a set of
live blocks without fragmentation: a lower bound of ``torch.cuda.memory_reserved()``.

Attention (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``): torch tries flash, then
memory-efficient, then math. Flash needs float16/bfloat16, no ``attn_mask``, 4-d inputs of equal head size
at most 256 (grouped-query heads allowed); memory-efficient takes float32 as well and any mask, but not
grouped-query heads, and needs the head size to be a multiple of 8 (half precision) or 4 (float32). Either
one handles dropout and ``is_causal``; the kernels' switches (``torch.backends.cuda.enable_flash_sdp`` ...)
are read. cuBLAS keeps one workspace per handle and stream from the caching allocator: ``CUBLAS_WORKSPACE_CONFIG``
or by default 4096 KiB x 2 + 16 KiB x 8 (8,519,680 bytes), 32 MiB on compute capability 9 (Hopper).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from gradscope.memory.targets.base import EFFICIENT, FLASH, MATH, Target

__all__ = ["CUDA", "MIN_BLOCK", "SMALL_SIZE", "SMALL_BUFFER", "LARGE_BUFFER", "MIN_LARGE_ALLOC", "ROUND_LARGE"]

MIN_BLOCK = 512  # every block is a multiple of this
SMALL_SIZE = 1 << 20  # the largest request of the small pool
SMALL_BUFFER = 2 << 20  # a small-pool segment
LARGE_BUFFER = 20 << 20  # a large-pool segment for requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # from here on, a segment is the request rounded up to ROUND_LARGE
ROUND_LARGE = 2 << 20

_HALF = (torch.float16, torch.bfloat16)
_MATMUL = ("Mm", "Addmm", "Bmm", "Baddbmm", "Linear", "Matmul", "Addbmm", "Addmv", "Mv", "Dot")


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


def cublas_workspace(capability: tuple[int, int], config: str | None) -> int:
    """Bytes of one cuBLAS workspace: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` pairs) when set, else
    torch's default for ``capability``."""
    if config:
        pairs = re.findall(r":(\d+):(\d+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return 32 << 20 if capability[0] == 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


@dataclass(frozen=True)
class CUDA(Target):
    """A CUDA device with torch's caching allocator (see NOTE [CUDA caching allocator]).

    Args:
        capability: the GPU's compute capability, ``(9, 0)`` for an H100 (``(8, 0)`` A100): the cuBLAS
            workspace and flash attention depend on it.
    """

    name: str = "cuda"
    measured: bool = False
    capability: tuple[int, int] = (9, 0)
    # class attributes, not fields (no annotation): see Target
    foreach = True
    note = "CUDA target: modelled, not measured on a GPU (torch's caching allocator and kernel rules)"
    unmodelled = (
        "workspace inside CUDA kernels (cuDNN convolution, attention backward, cuBLAS beyond its "
        "workspace): the CPU measurement stands in where one exists",
        "a large block served from the allocator's cache may count up to 1 MiB more than asked (an unsplit remainder)",
        "the CUDA context and the memory of other processes",
    )

    def allocated(self, nbytes: int) -> int:
        n = int(nbytes)
        if n <= 0:
            return 0
        block = max(MIN_BLOCK, _round(n, MIN_BLOCK))
        if block >= MIN_LARGE_ALLOC:
            segment = _round(block, ROUND_LARGE)
            if segment - block <= SMALL_SIZE:  # the remainder is too small to split off: counted with it
                return segment
        return block

    def reserved(self, blocks: Iterable[int]) -> int:
        small = mid = big = 0
        for b in blocks:
            a = self.allocated(b)
            if a == 0:
                continue
            if a <= SMALL_SIZE:
                small += a
            elif a < MIN_LARGE_ALLOC:
                mid += a
            else:
                big += _round(a, ROUND_LARGE)
        return _round(small, SMALL_BUFFER) + _round(mid, LARGE_BUFFER) + big

    def sdpa_backend(
        self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ) -> str:
        be = torch.backends.cuda
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            return MATH
        if min(query.shape[2], key.shape[2]) == 0 or len({query.dtype, key.dtype, value.dtype}) != 1:
            return MATH
        d, same = query.shape[-1], query.shape[-1] == key.shape[-1] == value.shape[-1]
        gqa = query.shape[1] != key.shape[1]
        if gqa and not enable_gqa:
            return MATH
        if be.flash_sdp_enabled() and self.capability >= (8, 0) and query.dtype in _HALF:
            if attn_mask is None and same and d <= 256:
                return FLASH
        if be.mem_efficient_sdp_enabled() and not gqa and query.dtype in (*_HALF, torch.float32):
            align = 8 if query.dtype in _HALF else 4
            if query.shape[-1] == key.shape[-1] and d % align == 0 and value.shape[-1] % align == 0:
                return EFFICIENT
        return MATH

    def fixed_parts(self, names: Iterable[str]) -> dict:
        if not any(n.startswith(_MATMUL) for n in names):
            return {}
        size = cublas_workspace(self.capability, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        return {"cuBLAS workspace (one stream)": self.allocated(size)}

    def __repr__(self) -> str:
        return f"CUDA(capability={self.capability})"
