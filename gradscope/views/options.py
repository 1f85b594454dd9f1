"""The render options, checked once: :class:`RenderOptions`; applying size/dpi/the pixel cap to a drawing."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gradscope._format import one_line
from gradscope.errors import InputTypeError, InputValueError
from gradscope.findings import Finding

if TYPE_CHECKING:
    import networkx as nx

__all__ = [
    "ReportLike",
    "RenderOptions",
    "RANKDIRS",
    "AUTO_LIMIT",
    "MAX_PIXELS",
    "RenderWarning",
    "size_attr",
    "scale",
    "cap_pixels",
]

#: Layout directions: top to bottom, left to right.
RANKDIRS = ("TB", "LR")
#: The most elements the default drawing has (beyond it: short labels, no clusters).
AUTO_LIMIT = 1000
#: Raster images (.png) larger than this many pixels on a side are scaled down, with a warning.
MAX_PIXELS = 8000


class ReportLike(Protocol):
    """What a view reads of a :class:`~gradscope.Report`: views take the report as an argument and never
    import its class (docs/architecture.md, the layers)."""

    findings: list[Finding]
    saved_bytes: int

    @property
    def graph(self) -> nx.DiGraph: ...

    def to_json(self) -> dict: ...


class RenderWarning(UserWarning):
    """A picture was changed to stay usable (a raster image scaled down to ``max_pixels``)."""


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """What a picture shows and how it is laid out: the options of ``render()``, ``to_dot()``,
    ``drawing()``, the HTML page and the CLI's flags, checked once when built.

    Fields (see :func:`gradscope.views.render.to_dot` for each): ``collapse`` (None: fit a page; N: box
    modules deeper than N; False: expand everything), ``fold``, ``show_saved``, ``clusters``, ``legend``,
    ``limit``, ``rankdir`` ("TB"/"LR", upper-cased), ``size`` (Graphviz's "W,H" in inches), ``dpi``,
    ``max_pixels``.

    Raises:
        InputValueError: a value out of range (one sentence naming the option and the value).

    Example:
        >>> RenderOptions(rankdir="lr", size=(8, 10)).rankdir, RenderOptions(size=(8, 10)).size
        ('LR', '8,10')
    """

    collapse: int | bool | None = None
    fold: bool | None = None
    show_saved: bool | None = None
    clusters: bool | None = None
    legend: bool = False
    limit: int = AUTO_LIMIT
    rankdir: str | None = None
    size: Any = None
    dpi: float | None = None
    max_pixels: int | None = MAX_PIXELS

    def __post_init__(self) -> None:
        c = self.collapse
        if c is not None and c is not False and (isinstance(c, bool) or not isinstance(c, int) or c < 0):
            raise InputValueError(
                f"collapse must be None (automatic), False (expand all) or a module depth >= 0, got {one_line(c)}."
            )
        if self.rankdir is not None:
            if not isinstance(self.rankdir, str) or self.rankdir.upper() not in RANKDIRS:
                raise InputValueError(
                    f"rankdir must be one of {', '.join(RANKDIRS)} (TB: top to bottom, LR: left to right), "
                    f"got {one_line(self.rankdir)}."
                )
            object.__setattr__(self, "rankdir", self.rankdir.upper())
        if self.size is not None:
            object.__setattr__(self, "size", size_attr(self.size))
        for name in ("dpi", "max_pixels"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                raise InputValueError(f"{name} must be a positive number or None, got {one_line(v)}.")
        lim = self.limit
        if isinstance(lim, bool) or not isinstance(lim, int) or lim < 1:
            raise InputValueError(f"limit must be a positive int (a node count), got {one_line(lim)}.")

    @classmethod
    def of(cls, options: RenderOptions | None = None, /, **kwargs: Any) -> RenderOptions:
        """``options`` (default: all defaults) with ``kwargs`` replacing its fields.

        Raises:
            InputTypeError: a keyword that is not an option (the message lists the options).
        """
        if options is not None and not isinstance(options, RenderOptions):
            raise InputTypeError(f"options must be a RenderOptions, got {type(options).__name__}.")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InputTypeError(
                f"unknown render option {one_line(unknown[0])}; the options are {', '.join(sorted(names))} "
                "(and format= for render())."
            )
        base = options if options is not None else cls()
        return dataclasses.replace(base, **kwargs) if kwargs else base

    def replace(self, **changes: Any) -> RenderOptions:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


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
            f"size must be (width, height) in inches, 'W,H' or one number, got {one_line(size)}; "
            f"for example size=(8, 10)."
        ) from None
    return f"{parts[0]:g},{parts[1]:g}"


def scale(drawing, options: RenderOptions) -> None:
    """Graphviz's ``size`` and ``dpi`` on ``drawing``'s Digraph, from ``options``."""
    if options.size is not None:
        drawing.dot.attr("graph", size=options.size)
    if options.dpi is not None:
        drawing.dot.attr("graph", dpi=f"{options.dpi:g}")


def cap_pixels(out, options: RenderOptions, path) -> None:
    """Scale a raster image down to ``max_pixels`` on its longer side, saying so (RenderWarning)."""
    max_pixels = options.max_pixels
    if out.size is None or max_pixels is None:
        return
    dpi = options.dpi or 96.0
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
        stacklevel=4,
    )
    out.dot.attr("graph", dpi=f"{new:.2f}")
