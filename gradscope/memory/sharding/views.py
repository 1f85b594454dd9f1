"""The picture of a :class:`ShardedStep`: one stacked bar per rank, the ceiling marked."""

from __future__ import annotations

from html import escape

from gradscope._format import human_bytes

__all__ = ["ranks_svg"]

_COLOURS = ("#9ecae1", "#d62728", "#2ca02c", "#ff9f40", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")


def ranks_svg(step, path=None, *, width: int = 640, bar: int = 18) -> str:
    """One bar per rank stacking its parts at the low peak; a tick at the high peak. Deterministic."""
    kinds: list[str] = []
    for parts in step.parts:
        kinds += [k for k, n in parts.items() if n > 0 and k not in kinds]
    colour = {k: _COLOURS[i % len(_COLOURS)] for i, k in enumerate(kinds)}
    label_w, value_w = 70, 150
    plot_w = max(60, width - label_w - value_w)
    legend_h = 16 * len(kinds)
    top = 30 + legend_h
    height = top + step.world_size * (bar + 6) + 8
    biggest = max(hi for _, hi in step.ranks) or 1
    lo, hi = step.peak_range
    title = f"{type(step.spec).__name__} x{step.world_size}: per-rank peak {human_bytes(lo)} .. {human_bytes(hi)}"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<text x="4" y="16" font-weight="bold">{escape(title)}</text>',
    ]
    for i, k in enumerate(kinds):
        y = 26 + 16 * i
        out.append(f'<rect x="4" y="{y}" width="10" height="10" fill="{colour[k]}"/>')
        out.append(f'<text x="18" y="{y + 9}">{escape(k)}</text>')
    for r, (parts, (low, high)) in enumerate(zip(step.parts, step.ranks)):
        y = top + r * (bar + 6)
        out.append(f'<text x="4" y="{y + bar - 5}">rank {r}</text>')
        x = float(label_w)
        for k in kinds:
            n = parts.get(k, 0)
            if n <= 0:
                continue
            w = plot_w * n / biggest
            out.append(
                f'<rect class="gs-shard-part" x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar}" fill="{colour[k]}">'
                f"<title>{escape(k)}: {human_bytes(n)}</title></rect>"
            )
            x += w
        xh = label_w + plot_w * high / biggest
        out.append(f'<line class="gs-shard-high" x1="{xh:.1f}" x2="{xh:.1f}" y1="{y}" y2="{y + bar}" stroke="black"/>')
        txt = human_bytes(low) if low == high else f"{human_bytes(low)} .. {human_bytes(high)}"
        out.append(f'<text x="{label_w + plot_w + 6}" y="{y + bar - 5}">{escape(txt)}</text>')
    out.append("</svg>")
    svg = "\n".join(out)
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(svg)
    return svg
