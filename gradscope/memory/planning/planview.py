"""Before/after memory curves of a what-if or a plan in one dependency-free SVG.

Each curve is a replay (``backward.py``'s ``BackwardMemory``) drawn in absolute bytes (``base`` plus the
level after each node of backward), over backward's progress (the node's position in the engine order, so
curves of different steps share the x axis), then the optimizer step as a last point when there is one.
Each curve's absolute peak is marked and labelled; a budget, when given, is a dashed line.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from gradscope._format import human_bytes

__all__ = ["curves_svg", "COLOURS"]

COLOURS = ("#7f7f7f", "#1f77b4", "#2ca02c", "#d62728", "#9467bd")


def _points(bm) -> list[tuple[float, int]]:
    n = max(1, len(bm.levels))
    pts = [(0.0, bm.base)] + [((i + 1) / n, bm.base + lv) for i, lv in enumerate(bm.levels)]
    if bm.step is not None:
        pts.append((1.0, bm.absolute_peak))
    return pts


def curves_svg(
    curves,
    path=None,
    *,
    budget: int | None = None,
    width: int = 720,
    height: int = 320,
    title: str = "memory of the step (backward, then optimizer.step)",
) -> str:
    """``curves``: ``[(label, BackwardMemory)]``; returns the SVG text and writes it to ``path`` when given."""
    left, right, top, bottom = 80, 16, 48 + 16 * len(curves), 36
    pw, ph = width - left - right, height - top - bottom
    series = [(label, _points(bm), bm.absolute_peak) for label, bm in curves]
    hi = max([p for _, pts, peak in series for p in [peak] + [y for _, y in pts]] + [budget or 0]) or 1
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
    out.append(f'<text x="{left + pw}" y="{height - 10}" text-anchor="end" fill="#555">end of the step</text>')
    if budget:
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{Y(budget):.1f}" y2="{Y(budget):.1f}" '
            f'stroke="#d62728" stroke-dasharray="6 4"/>'
        )
        out.append(
            f'<text x="{left + pw - 4}" y="{Y(budget) - 4:.1f}" text-anchor="end" fill="#d62728">'
            f"budget {escape(human_bytes(budget))}</text>"
        )
    for k, (label, pts, peak) in enumerate(series):
        colour = COLOURS[k % len(COLOURS)]
        d = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in pts)
        out.append(
            f'<polyline class="curve" fill="none" stroke="{colour}" stroke-width="2" points="{d}">'
            f"<title>{escape(label)}</title></polyline>"
        )
        px = max(pts, key=lambda p: p[1])[0] if pts else 0
        out.append(
            f'<circle class="peak" cx="{X(px):.1f}" cy="{Y(peak):.1f}" r="4" fill="{colour}">'
            f"<title>{escape(label)}: peak {escape(human_bytes(peak))}</title></circle>"
        )
        ly = 36 + 16 * k
        out.append(f'<rect x="4" y="{ly - 9}" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="18" y="{ly}">{escape(label)}: peak {escape(human_bytes(peak))}</text>')
    out.append("</svg>")
    svg = "\n".join(out)
    if path is not None:
        Path(path).write_text(svg, encoding="utf-8")
    return svg
