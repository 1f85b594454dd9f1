"""Checking render() options, and applying the size/dpi/pixel-cap ones to a drawing."""

from __future__ import annotations

import warnings

from gradscope.errors import InputValueError

__all__ = ["RANKDIRS", "MAX_PIXELS", "RenderWarning", "check", "size_attr", "scale", "cap_pixels"]

#: Layout directions: top to bottom, left to right.
RANKDIRS = ("TB", "LR")
#: Raster images (.png) larger than this many pixels on a side are scaled down, with a warning.
MAX_PIXELS = 8000


class RenderWarning(UserWarning):
    """A picture was changed to stay usable (a raster image scaled down to ``max_pixels``)."""


def check(collapse, rankdir, size, dpi, max_pixels):
    if (
        collapse is not None
        and collapse is not False
        and (isinstance(collapse, bool) or not isinstance(collapse, int) or collapse < 0)
    ):
        raise InputValueError(
            f"collapse must be None (automatic), False (expand all) or a module depth >= 0, got {collapse!r}."
        )
    if rankdir is not None and (not isinstance(rankdir, str) or rankdir.upper() not in RANKDIRS):
        raise InputValueError(
            f"rankdir must be one of {', '.join(RANKDIRS)} (TB: top to bottom, LR: left to right), got {rankdir!r}."
        )
    if size is not None:
        size_attr(size)
    for name, v in (("dpi", dpi), ("max_pixels", max_pixels)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise InputValueError(f"{name} must be a positive number or None, got {v!r}.")


def size_attr(size) -> str:
    """Graphviz's ``size`` (inches, "W,H"): from ``(w, h)``, ``"W,H"`` or one number (a square)."""
    try:
        if isinstance(size, str):
            parts = [float(x) for x in size.rstrip("!").split(",")]
        elif isinstance(size, (int, float)) and not isinstance(size, bool):
            parts = [float(size)] * 2
        else:
            parts = [float(x) for x in size]
        if len(parts) != 2 or min(parts) <= 0:
            raise ValueError
    except (TypeError, ValueError):
        raise InputValueError(
            f"size must be (width, height) in inches, 'W,H' or one number, got {size!r}; for example size=(8, 10)."
        ) from None
    return f"{parts[0]:g},{parts[1]:g}"


def scale(drawing, size, dpi):
    if size is not None:
        drawing.dot.attr("graph", size=size_attr(size))
    if dpi is not None:
        drawing.dot.attr("graph", dpi=f"{dpi:g}")


def cap_pixels(out, dpi, max_pixels, path) -> None:
    """Scale a raster image down to ``max_pixels`` on its longer side, saying so (RenderWarning)."""
    if out.size is None or max_pixels is None:
        return
    dpi = dpi or 96.0
    side = max(out.size) / 72 * dpi
    if side <= max_pixels:
        return
    new = dpi * max_pixels / side * 0.98  # dot rounds up and pads a little
    w, h = (round(x / 72 * dpi) for x in out.size)
    warnings.warn(
        f"{path}: a {w:,} x {h:,} px image would be written; scaled down to {max_pixels:,} px on its "
        f"longer side (dpi {new:.0f}). Pass max_pixels=None (CLI --max-pixels 0) for full size, or "
        f"write .svg/.pdf, which scale without loss.",
        RenderWarning,
        stacklevel=3,
    )
    out.dot.attr("graph", dpi=f"{new:.2f}")
