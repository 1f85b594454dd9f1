"""A dependency-free horizontal stacked bar chart as an SVG string (for ``MemoryTable.to_svg``), and what
every ``to_svg(path=None)`` returns (:func:`svg_or_path`)."""

from __future__ import annotations

import os
from html import escape

from gradscope._format import human_bytes
from gradscope.errors import RenderError

__all__ = ["bar_chart", "SERIES", "svg_or_path"]

#: (row attribute, legend label, fill colour), stacked left to right.
SERIES = (
    ("held", "activations", "#d62728"),
    ("params", "parameters (by reference)", "#9ecae1"),
    ("offloaded", "moved to CPU", "#ff9f40"),
)


def bar_chart(rows, *, title: str = "", width: int = 640, bar: int = 18) -> str:
    """One bar per row, stacking the :data:`SERIES` byte counts; deterministic output.

    Args:
        rows: objects with ``name`` and the :data:`SERIES` attributes (``MemoryRow``).
        title: the text above the chart.
        width: total width in pixels.
        bar: bar height in pixels.

    Returns:
        A standalone ``<svg>`` document (display it with ``IPython.display.SVG``).
    """
    rows = list(rows)
    label_w = min(260, 12 + 7 * max((len(r.name) for r in rows), default=4))
    value_w = 80
    plot_w = max(60, width - label_w - value_w)
    top = 44
    height = top + len(rows) * (bar + 6) + 8
    biggest = max((sum(getattr(r, a) for a, _, _ in SERIES) for r in rows), default=0) or 1
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<text x="4" y="14" font-weight="bold">{escape(title)}</text>',
    ]
    x: float = 4  # legend: int positions; bars: float
    for _, label, colour in SERIES:
        out.append(f'<rect x="{x}" y="22" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="{x + 14}" y="31">{escape(label)}</text>')
        x += 24 + 7 * len(label)
    for i, r in enumerate(rows):
        y = top + i * (bar + 6)
        name = r.name if len(r.name) * 7 + 12 <= label_w else r.name[: max(1, (label_w - 12) // 7 - 1)] + "…"
        out.append(
            f'<text x="{label_w - 6}" y="{y + bar - 5}" text-anchor="end">'
            f"<title>{escape(r.name)}</title>{escape(name)}</text>"
        )
        x = float(label_w)
        total = 0
        for attr, label, colour in SERIES:
            v = getattr(r, attr)
            total += v
            if v <= 0:
                continue
            w = plot_w * v / biggest
            out.append(
                f'<rect x="{x:.1f}" y="{y}" width="{max(w, 1.0):.1f}" height="{bar}" fill="{colour}">'
                f"<title>{escape(r.name)}: {escape(human_bytes(v))} {escape(label)}</title></rect>"
            )
            x += w
        out.append(f'<text x="{x + 4:.1f}" y="{y + bar - 5}">{escape(human_bytes(total))}</text>')
    out.append("</svg>")
    return "\n".join(out)


def svg_or_path(svg: str, path: str | os.PathLike[str] | None) -> str:
    """What every ``to_svg(path=None)`` returns: the SVG text without ``path``; with it, the text written
    there and the path (as a string), as ``report.render(path)`` does.

    Raises:
        RenderError: the file cannot be written (one sentence with the reason).
    """
    if path is None:
        return svg
    out = os.fspath(path)
    try:
        with open(out, "w", encoding="utf-8") as f:
            f.write(svg)
    except OSError as exc:
        raise RenderError(f"cannot write {out!r}: {exc.strerror or exc}. Check that the folder exists.") from None
    return out
