"""Bytes per element of gradscope's dtype strings, for the memory replay (no torch needed)."""

from __future__ import annotations

from math import prod

__all__ = ["DTYPE_BYTES", "numel_bytes"]

DTYPE_BYTES = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def numel_bytes(shape, dtype: str | None) -> int:
    """Dense bytes of a tensor of ``shape`` and ``dtype`` (a gradscope dtype string)."""
    n = 1
    if shape:
        try:
            p = prod(shape)
        except TypeError:
            p = None
        if type(p) is int:
            n = p
        else:  # not plain ints (a float, a string...): each converted, as int() does
            for s in shape:
                n *= int(s)
    return n * DTYPE_BYTES.get(dtype or "float32", 4)
