"""Before/after memory curves of a what-if or a plan in one dependency-free SVG.

Each curve is a replay (``backward.py``'s ``BackwardMemory``) drawn in absolute bytes (``base``, what is
alive when backward starts, plus the level): over backward's progress (the node's position in the engine
order, so curves of different steps share the x axis), each node drawn at its highest point inside it
(workspace included) then at its level after it; then, when there is an optimizer, ``optimizer.step()`` as
a phase of its own on the right (its peak, then its end). Each curve's absolute peak is marked where it
happens: at its node of backward, or inside ``optimizer.step()``. A budget, when given, is a dashed line.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from gradscope._format import human_bytes

__all__ = ["curves_svg", "curve_points", "COLOURS", "BACKWARD_SHARE"]

COLOURS = ("#7f7f7f", "#1f77b4", "#2ca02c", "#d62728", "#9467bd")
#: Share of the x axis that backward takes when an optimizer step follows it.
BACKWARD_SHARE = 0.8


def curve_points(bm, share: float = 1.0) -> tuple[list[tuple[float, int]], tuple[float, int]]:
    """``(points, peak)``: the curve as ``(x in [0, 1], absolute bytes)`` and its absolute peak's point.

    Backward spans ``[0, share]``: node ``i`` of ``n`` has its inside peak at ``(i + 0.5) / n`` and its level
    after it at ``(i + 1) / n``; ``optimizer.step()`` (when ``bm.step``) spans ``[share, 1]``: its peak in the
    middle, its end at 1. The peak is the first highest point (``bm.absolute_peak``'s place)."""
    n = max(1, len(bm.levels))
    base = bm.base
    pts: list[tuple[float, int]] = [(0.0, base)]
    inner = bm.inner if len(bm.inner) == len(bm.levels) else bm.levels
    for i, (top, after) in enumerate(zip(inner, bm.levels)):
        pts.append((share * (i + 0.5) / n, base + top))
        pts.append((share * (i + 1) / n, base + after))
    if bm.step is not None:
        start = base + bm.end
        pts.append((share + (1 - share) / 2, start + bm.step.peak))
        pts.append((1.0, start + bm.step.end))
    top_point = max(pts, key=lambda p: p[1])  # max() keeps the first of equal points
    return pts, top_point


def curves_svg(
    curves,
    path=None,
    *,
    budget: int | None = None,
    width: int = 720,
    height: int = 320,
    title: str = "memory of the step, absolute (backward, then optimizer.step)",
) -> str:
    """``curves``: ``[(label, BackwardMemory)]``; returns the SVG text and writes it to ``path`` when given."""
    left, right, top, bottom = 80, 16, 48 + 16 * len(curves), 36
    pw, ph = width - left - right, height - top - bottom
    share = BACKWARD_SHARE if any(bm.step is not None for _, bm in curves) else 1.0
    series = [(label, *curve_points(bm, share)) for label, bm in curves]
    hi = max([y for _, pts, _ in series for _, y in pts] + [budget or 0]) or 1
    lo: float = min([y for _, pts, _ in series for _, y in pts] + ([budget] if budget else []))
    lo = max(0, lo - (hi - lo) * 0.1)
    span = (hi - lo) or 1

    def X(x):
        return left + pw * x

    def Y(y):
        return top + ph * (1 - (y - lo) / span)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<text x="4" y="16" font-weight="bold">{escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#ccc"/>',
    ]
    for i in range(5):
        v = lo + span * i / 4
        out.append(
            f'<text x="{left - 6}" y="{Y(v) + 4:.1f}" text-anchor="end" fill="#555">{escape(human_bytes(v))}</text>'
        )
    out.append(f'<text x="{left}" y="{height - 10}" fill="#555">backward start</text>')
    if share < 1:
        out.append(
            f'<line class="phase" x1="{X(share):.1f}" x2="{X(share):.1f}" y1="{top}" y2="{top + ph}" '
            f'stroke="#bbb" stroke-dasharray="3 3"><title>end of backward</title></line>'
        )
        out.append(
            f'<text x="{X((1 + share) / 2):.1f}" y="{height - 10}" text-anchor="middle" fill="#555">'
            "optimizer.step()</text>"
        )
    else:
        out.append(f'<text x="{left + pw}" y="{height - 10}" text-anchor="end" fill="#555">end of backward</text>')
    if budget:
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{Y(budget):.1f}" y2="{Y(budget):.1f}" '
            f'stroke="#d62728" stroke-dasharray="6 4"/>'
        )
        out.append(
            f'<text x="{left + pw - 4}" y="{Y(budget) - 4:.1f}" text-anchor="end" fill="#d62728">'
            f"budget {escape(human_bytes(budget))}</text>"
        )
    for k, (label, pts, (px, peak)) in enumerate(series):
        colour = COLOURS[k % len(COLOURS)]
        d = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in pts)
        out.append(
            f'<polyline class="curve" fill="none" stroke="{colour}" stroke-width="2" points="{d}">'
            f"<title>{escape(label)}</title></polyline>"
        )
        where = "during optimizer.step()" if px > share else "during backward"
        out.append(
            f'<circle class="peak" cx="{X(px):.1f}" cy="{Y(peak):.1f}" r="4" fill="{colour}">'
            f"<title>{escape(label)}: peak {escape(human_bytes(peak))} {where}</title></circle>"
        )
        ly = 36 + 16 * k
        out.append(f'<rect x="4" y="{ly - 9}" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="18" y="{ly}">{escape(label)}: peak {escape(human_bytes(peak))} {where}</text>')
    out.append("</svg>")
    svg = "\n".join(out)
    if path is not None:
        Path(path).write_text(svg, encoding="utf-8")
    return svg
