"""The gradient-flow picture: a dependency-free SVG heat map, one row per module, one column per step.

Each cell's colour is the module's gradient L2 norm on that checked step (log10 scale by default, from dark
blue for the smallest to yellow for the largest); cells flagged vanishing or exploding get a red outline,
a module with no gradient on a step is left grey, and every cell carries a ``<title>`` tooltip with the
exact value. Same style as :mod:`gradscope.svgchart`.
"""

from __future__ import annotations

import math
from html import escape

__all__ = ["flow_chart", "flow_svg", "CHAR_PX"]

#: The widest a character of 12 px sans-serif text averages over a line (DejaVu Sans, bold: about 7.3 px).
CHAR_PX = 7.5

# viridis, 8 stops
_STOPS = ("#440154", "#46327e", "#365c8d", "#277f8e", "#1fa187", "#4ac16d", "#a0da39", "#fde725")


def _colour(t: float) -> str:
    t = min(1.0, max(0.0, t))
    x = t * (len(_STOPS) - 1)
    i = min(int(x), len(_STOPS) - 2)
    f = x - i
    a, b = _STOPS[i], _STOPS[i + 1]
    rgb = [round(int(a[k : k + 2], 16) * (1 - f) + int(b[k : k + 2], 16) * f) for k in (1, 3, 5)]
    return "#" + "".join(f"{c:02x}" for c in rgb)


def flow_chart(steps, history, modules, flags, *, title="gradient flow", log=True, cell=14, max_columns=200) -> str:
    """Args: ``steps`` (backward number per entry), ``history`` (``{module: norm}`` per entry), ``modules``
    (row order), ``flags`` (``(backward, module, kind, norm)``). Returns a standalone ``<svg>`` document;
    with more than ``max_columns`` entries, evenly spaced ones are shown."""
    if len(history) > max_columns:
        pick = [round(i * (len(history) - 1) / (max_columns - 1)) for i in range(max_columns)]
        steps, history = [steps[i] for i in pick], [history[i] for i in pick]
    flagged = {(b, m): k for b, m, k, _ in flags}
    values = [v for e in history for v in e.values() if math.isfinite(v) and (v > 0 or not log)]

    def scale(v):
        return math.log10(v) if log else v

    lo = min(map(scale, values), default=0.0)
    hi = max(map(scale, values), default=1.0)
    span = (hi - lo) or 1.0
    lo_text = f"{10**lo:.2g}" if log else f"{lo:.2g}"
    hi_text = f"{10**hi:.2g}" if log else f"{hi:.2g}"
    label_w = min(260, 12 + 7 * max((len(m or "(root)") for m in modules), default=6))
    label_w = max(label_w, 12 + round(CHAR_PX * len(lo_text)))  # the scale's low end is drawn left of the bar
    caption = [
        f"gradient L2 norm per module{' (log10)' if log else ''}, one column per checked step;",
        "red outline: vanishing / exploding",
    ]
    top, legend_h = 58, 34
    width = label_w + max(len(history), 1) * cell + 20
    # the text sets the least width: CHAR_PX per character holds for any sans-serif at 12 px
    width = max(width, 360, *(8 + round(CHAR_PX * len(t)) for t in [*caption, title]))
    height = top + len(modules) * cell + legend_h
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<text x="4" y="14" font-weight="bold">{escape(title)}</text>',
        *(f'<text x="4" y="{31 + 14 * i}">{escape(t)}</text>' for i, t in enumerate(caption)),
    ]
    for r, m in enumerate(modules):
        name = m or "(root)"
        y = top + r * cell
        shown = name if len(name) * 7 + 12 <= label_w else name[: max(1, (label_w - 12) // 7 - 1)] + "…"
        out.append(
            f'<text x="{label_w - 6}" y="{y + cell - 3}" text-anchor="end">'
            f"<title>{escape(name)}</title>{escape(shown)}</text>"
        )
        for c, (b, entry) in enumerate(zip(steps, history)):
            x = label_w + c * cell
            v = entry.get(m)
            kind = flagged.get((b, m))
            if v is None:
                fill, text = "#dddddd", "no gradient"
            elif not math.isfinite(v):
                fill, text = "#000000", f"{v}"
            elif log and v <= 0:
                fill, text = _colour(0.0), "0"
            else:
                fill, text = _colour((scale(v) - lo) / span), f"{v:.3g}"
            stroke = ' stroke="#d62728" stroke-width="2"' if kind else ""
            out.append(
                f'<rect class="cell" x="{x}" y="{y}" width="{cell - 1}" height="{cell - 1}" '
                f'fill="{fill}"{stroke}><title>{escape(name)}, backward {b}: {escape(text)}'
                f"{' (' + kind + ')' if kind else ''}</title></rect>"
            )
    y = top + len(modules) * cell + 10
    for i in range(10):
        out.append(f'<rect x="{label_w + i * 12}" y="{y}" width="12" height="10" fill="{_colour(i / 9)}"/>')
    out.append(f'<text x="{label_w - 6}" y="{y + 10}" text-anchor="end">{escape(lo_text)}</text>')
    out.append(f'<text x="{label_w + 126}" y="{y + 10}">{escape(hi_text)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def flow_svg(flow, title: str, path=None, log: bool = True) -> str:
    """``guard.flow_svg()``: the chart of a :class:`~gradscope.watching.flow.Flow`: the SVG text, or with
    ``path`` the file written and its path (as ``render(path)``)."""
    from gradscope.svgchart import svg_or_path

    svg = flow_chart(list(flow.steps), list(flow.history), flow.modules, list(flow.flags), title=title, log=log)
    return svg_or_path(svg, path)
