"""Small formatting helpers shared by the text, DOT and HTML views."""

from __future__ import annotations

__all__ = ["human_bytes", "shape_str", "lcp", "one_line", "plural"]


def plural(n: int, word: str, many: str | None = None) -> str:
    """``plural(1, "saved tensor") == '1 saved tensor'``, ``plural(2, "node") == '2 nodes'``; ``many`` for
    an irregular plural (``plural(3, "parameter is", "parameters are")``)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def one_line(v, limit: int = 60) -> str:
    """``repr(v)`` on one line (whitespace runs collapsed), cut to ``limit`` characters; never raises."""
    try:
        text = " ".join(repr(v).split())
    except Exception:  # noqa: BLE001 - a user object whose __repr__ raises
        return "<unprintable>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def human_bytes(n: int | float) -> str:
    """``1536 -> '1.5 KiB'``; exact bytes below 1 KiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def shape_str(shape) -> str:
    """``[2, 3] -> '2×3'``; ``[] -> 'scalar'``; None -> '?'."""
    if shape is None:
        return "?"
    return "×".join(str(s) for s in shape) if shape else "scalar"


def lcp(a: str | None, b: str | None) -> str | None:
    """Longest common dotted prefix: ``lcp('a.b.c', 'a.b.d') == 'a.b'``; None when nothing is shared."""
    if not a or not b:
        return None
    if a == b:
        return a
    out = []
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        out.append(x)
    return ".".join(out) or None
