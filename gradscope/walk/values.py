"""Saved non-tensor values (sizes, dims, flags, dtypes) as plain, JSON-friendly Python values."""

from __future__ import annotations

import torch

__all__ = ["plain_value", "dtype_str", "DTYPES"]

_U64 = 2**64
_I64_MAX = 2**63
#: torch.dtype -> its name without the ``torch.`` prefix (the walk reads it with ``.get`` in hot loops)
DTYPES: dict = {}


def dtype_str(dtype) -> str:
    """``torch.float32 -> 'float32'`` (cached in :data:`DTYPES`)."""
    text = DTYPES.get(dtype)
    if text is None:
        text = DTYPES[dtype] = str(dtype).removeprefix("torch.")
    return text


def plain_value(v):
    """Turn a saved non-tensor value into a plain, JSON-friendly Python value."""
    tv = type(v)
    if tv is int:
        return v - _U64 if v >= _I64_MAX else v
    if tv is tuple or tv is list:
        try:  # fast path: sizes, strides, dims (numbers); max() raises on None/mixed/empty
            if max(v) < _I64_MAX:
                return list(v)
        except (TypeError, ValueError):
            pass
        return [plain_value(x) for x in v]
    if tv is bool or v is None or tv is float or tv is str:
        return v
    if isinstance(v, int):
        return v - _U64 if v >= _I64_MAX else v
    if isinstance(v, (tuple, list)):
        return [plain_value(x) for x in v]
    if isinstance(v, torch.Tensor):
        return f"Tensor{list(v.shape)}"
    if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(v).removeprefix("torch.")
    try:
        return int(v)  # SymInt and friends
    except Exception:  # noqa: BLE001
        return repr(v)[:80] if _safe_repr_ok(v) else type(v).__name__


def _safe_repr_ok(v) -> bool:
    try:
        repr(v)
    except Exception:  # noqa: BLE001 - user objects whose __repr__ raises
        return False
    return True
