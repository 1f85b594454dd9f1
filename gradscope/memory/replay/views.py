"""Views of a :class:`~gradscope.memory.result.BackwardMemory`: text, the step budget table, the SVG curve."""

from __future__ import annotations

import html
from pathlib import Path

from gradscope._format import human_bytes, plural
from gradscope.graph.attribution import NO_MODULE

__all__ = ["text", "budget_rows", "phase_peaks", "curve_svg", "repr_html", "BAND_COLOURS"]

BAND_COLOURS = ("#e8f0fb", "#fbeee8", "#eaf7ea", "#f6eefb", "#fbf8e3", "#e9f6f7")


def _where(bm) -> str:
    if bm.peak_node is None:
        return "nowhere (empty graph)"
    i = bm.order.index(bm.peak_node)
    text = f"node {bm.peak_node} {bm.names[i]}"
    mod = bm.modules[i]
    if mod and mod != NO_MODULE:  # "(no module)": the loss, or an op of the model's own forward
        text += f" in module {mod}"
    loc = bm.locations.get(bm.peak_node)
    if loc:
        text += f" ({loc})"
    return text


def phase_peaks(bm) -> dict[str, int]:
    """The first step's phases and the absolute peak of each: ``{"backward": ..., "AdamW.step()": ...}``
    (bytes alive when backward starts plus the highest level the phase reaches). ``bm.first_step``'s peak is
    their maximum, never their sum."""
    out = {"backward": bm.base + max(bm.peak, 0)}
    if bm.step is not None:
        out[f"{bm.step.name}.step()"] = bm.base + bm.end + bm.step.peak
    return out


def _later_phases(bm) -> dict[str, int]:
    later = bm.later_step
    out = {"backward": later.backward_peak}
    if bm.step is not None and later.optimizer_peak is not None:
        out[f"{bm.step.name}.step()"] = later.optimizer_peak
    return out


#: The prefix of the later step's rows in ``bm.table()``.
LATER = "later steps: "


def budget_rows(bm) -> list[tuple[str, int]]:
    """``(what, bytes)`` rows of the step budget. The first step (as inspected): what is alive when backward
    starts, by kind, and their sum; each phase's absolute peak; ``peak of the first step``, the largest
    phase (not a sum of rows). Then the same rows for the later steps (NOTE [first and later steps] in
    replay/steady.py), prefixed ``later steps: ``; last ``absolute peak of the step``, the higher of the
    two steps (``bm.absolute_peak``)."""
    rows = [(k, v) for k, v in bm.parts.items() if v]
    rows.append(("alive when backward starts", bm.base))
    rows += [(f"peak during {phase}", b) for phase, b in phase_peaks(bm).items()]
    rows.append(("peak of the first step", bm.first_step.absolute_peak))
    later = bm.later_step
    rows += [(LATER + k, v) for k, v in later.parts.items() if v]
    rows.append((LATER + "alive when backward starts", later.base))
    rows += [(f"{LATER}peak during {phase}", b) for phase, b in _later_phases(bm).items()]
    rows.append(("peak of a later step", later.absolute_peak))
    rows.append(("absolute peak of the step", bm.absolute_peak))
    return rows


def _top(phases: dict) -> str:
    return max(phases, key=lambda k: phases[k])


def _budget_lines(bm) -> list[str]:
    """The step budget as text: the first step's parts, their sum, its phases' absolute peaks; the same for
    a later step; the higher of the two."""
    rows = budget_rows(bm)
    width = max(len(k.removeprefix(LATER)) for k, _ in rows) + 2
    first_phases, later_phases = phase_peaks(bm), _later_phases(bm)
    first, later = bm.first_step, bm.later_step
    lines = ["step budget (absolute bytes; a step's peak is its largest phase, not a sum of the rows):"]
    lines.append(f"first step ({first.how}):")
    for k, v in rows:
        if k.startswith(LATER):
            k = k.removeprefix(LATER)
            if k == "alive when backward starts":
                lines.append(f"  {'= ' + k:<{width}}  {human_bytes(v):>10}")
            elif k == "peak during backward":
                rise = max((r for _, _, r in later.micro_steps), default=0)
                lines.append(f"  {k:<{width}}  {human_bytes(v):>10}  (+{human_bytes(rise)} above its start)")
            elif k.startswith("peak during "):
                lines.append(f"  {k:<{width}}  {human_bytes(v):>10}  (no new state)")
            else:
                lines.append(f"    {k:<{width - 2}}  {human_bytes(v):>10}")
        elif k == "alive when backward starts":
            lines.append(f"  {'= ' + k:<{width}}  {human_bytes(v):>10}")
        elif k == "peak during backward":
            lines.append(f"  {k:<{width}}  {human_bytes(v):>10}  (+{human_bytes(max(bm.peak, 0))} above its start)")
        elif k.startswith("peak during ") and bm.step is not None:
            st = bm.step
            lines.append(
                f"  {k:<{width}}  {human_bytes(v):>10}  (+{human_bytes(st.peak)} above the end of backward, "
                f"{human_bytes(bm.base + bm.end)}; new state {human_bytes(st.state_new)}, kept)"
            )
        elif k == "peak of the first step":
            if len(first.micro_steps) > 1:
                lines.append(
                    f"  {'peak during ' + first.micro_steps[-1][0]:<{width}}  "
                    f"{human_bytes(first.micro_steps[-1][1] + first.micro_steps[-1][2]):>10}  (.grad set)"
                )
            lines.append(f"  {k:<{width}}  {human_bytes(v):>10}  (max of the phases: during {_top(first_phases)})")
            lines.append(f"later steps ({later.how}):")
        elif k == "peak of a later step":
            lines.append(f"  {k:<{width}}  {human_bytes(v):>10}  (max of the phases: during {_top(later_phases)})")
        elif k == "absolute peak of the step":
            which = (
                "a later step"
                if later.absolute_peak > first.absolute_peak
                else "the first step"
                if later.absolute_peak < first.absolute_peak
                else "both alike"
            )
            lines.append(f"{k + ':':<{width + 2}}  {human_bytes(v):>10}  (the higher of the two: {which})")
        else:
            lines.append(f"    {k:<{width - 2}}  {human_bytes(v):>10}")
    return lines


def text(bm, top: int = 5) -> str:
    """What ``print(bm)`` shows: the peak, where it is, the step budget and the top contributors."""
    lines = [
        f"backward() memory, replayed before it runs: peak {human_bytes(bm.peak)} above its start, at {_where(bm)}.",
        f"  {len(bm.order)} nodes; after backward: {'+' if bm.end >= 0 else ''}{human_bytes(bm.end)} "
        "(gradients kept minus saved tensors freed).",
    ]
    target = getattr(bm, "target", None)
    if target is not None and target.note:  # NOTE [device targets]: a prediction not checked on its device
        lines.append(f"  {target.note}; not modelled: {'; '.join(target.unmodelled)}.")
        lines.append(
            f"  reserved by the allocator at backward's peak (estimate, a lower bound): {human_bytes(bm.reserved())}."
        )
    if bm.workspace:
        ws = sum(bm.workspace.values())
        lines.append(
            f"  in-node memory (kernel workspace and temporaries, measured per op signature): "
            f"{plural(len(bm.workspace), 'node')}, up to "
            f"{human_bytes(max(bm.workspace.values()))} in one node ({human_bytes(ws)} in all)."
        )
    lines.extend(_custom_lines(bm))
    unknown = bm.innode_unknown
    regions = [n for n in bm.unmodelled if n not in unknown]
    if regions:
        n = len(regions)
        its = "their" if n > 1 else "its"
        why = next((bm.unmodelled_why[r] for r in regions if r in bm.unmodelled_why), None)
        hint = f"Traced, but not replayed: {why}." if why else "gradscope.trace() around the forward models them."
        lines.append(
            f"  NOTE: {n} reentrant checkpoint region{'s' if n > 1 else ''} ({', '.join(regions[:4])}"
            f"{', ...' if n > 4 else ''}): backward re-runs {its} forward, which no graph shows before it runs; "
            f"{its} recompute and nested backward are not in these numbers, so the peaks are lower bounds. "
            f"{hint} checkpoint(..., use_reentrant=False) is replayed exactly."
        )
    if unknown:
        lines.extend(_unknown_lines(bm, unknown))
    for note in bm.uncounted:
        lines.append(f"  NOTE: {note}.")
    for note in bm.notes:
        lines.append(f"  {note}")
    lines += _budget_lines(bm)
    every = bm.contributors()
    rows = [r for r in every if r[2] > 0][:top] + [r for r in every if r[2] < 0]
    if rows:
        lines.append("the peak, by module (what backward made and still holds there, minus what it freed):")
        mw = max(len(m) for m, _, _ in rows)
        for m, kind, b in rows:
            lines.append(f"  {m:<{mw}}  {kind:<24} {human_bytes(b):>10}")
    return "\n".join(lines)


def _custom_lines(bm) -> list[str]:
    """How each custom autograd.Function's backward was run to measure it, one line per way."""
    runs = getattr(bm, "custom_runs", None) or {}
    names = dict(zip(bm.order, bm.names))
    by_how: dict = {}
    for nid, how in runs.items():
        by_how.setdefault(how, []).append(nid)
    lines = []
    for how, nids in sorted(by_how.items()):
        ops = sorted({names.get(x, x) for x in nids})
        shown = ", ".join(ops[:4]) + (", ..." if len(ops) > 4 else "")
        lines.append(
            f"  custom autograd.Function backward{'s' if len(nids) > 1 else ''} run on {how} to measure "
            f"{'their' if len(nids) > 1 else 'its'} in-node memory: {shown} ({len(nids)})."
        )
    return lines


def _unknown_lines(bm, unknown: dict) -> list[str]:
    """The lower-bound note: nodes whose in-node memory is not known, grouped by reason."""
    names = dict(zip(bm.order, bm.names))
    by_why: dict = {}
    for nid, why in unknown.items():
        by_why.setdefault(why, []).append(nid)
    n = len(unknown)
    lines = [
        f"  NOTE: the in-node memory of {n} node{'s' if n > 1 else ''} is not known, so the peaks are lower "
        "bounds (backward can go higher inside them):"
    ]
    for why, nids in sorted(by_why.items(), key=lambda kv: -len(kv[1]))[:4]:
        ops = sorted({names.get(x, x) for x in nids})
        where = [bm.locations[x] for x in nids if x in bm.locations][:2]
        at = f" at {', '.join(where)}" if where else ""
        lines.append(f"    {', '.join(ops[:3])}{', ...' if len(ops) > 3 else ''} ({len(nids)}{at}): {why}.")
    if len(by_why) > 4:
        lines.append(f"    ... and {len(by_why) - 4} more reasons (bm.innode_unknown).")
    return lines


def _bands(bm, most: int = 12) -> list[tuple[int, int, str]]:
    """Runs of consecutive nodes in one module, ``(first, last, module)``, at the deepest module level
    that gives at most ``most`` runs (top-level modules when even those are more)."""
    best = None
    for depth in range(1, 6):
        out: list[tuple[int, int, str]] = []
        for i, mod in enumerate(bm.modules):
            head = ".".join(mod.split(".")[:depth]) if mod else ""
            if out and out[-1][2] == head:
                out[-1] = (out[-1][0], i, head)
            else:
                out.append((i, i, head))
        if best is None or len(out) <= most:
            best = out
        if len(out) > most:
            break
    return best or []


def curve_svg(bm, path=None, *, width: int = 720, height: int = 300, budget: int | None = None) -> str:
    """Memory over backward in absolute bytes, as the what-if chart draws it (``bm.base``, what is alive when
    backward starts, plus the level after each node and inside each node), module bands behind, backward's
    start as a dotted line, the peak marked. Returns the SVG text; writes it to ``path`` when given."""
    left, right, top, bottom = 84, 16, 44, 40
    pw, ph = width - left - right, height - top - bottom
    n = max(1, len(bm.levels))
    base = bm.base
    values = [base + v for v in (*bm.levels, *bm.inner, 0)] + ([budget] if budget else [])
    hi, lo = max(values), min(values)
    lo = max(0, lo - (hi - lo) * 0.1)
    span = (hi - lo) or 1

    def X(i):
        return left + pw * (i + 0.5) / n

    def Y(v):  # v: bytes above backward's start
        return top + ph * (1 - (base + v - lo) / span)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<text x="4" y="16" font-weight="bold">memory during backward (replayed, absolute): peak '
        f"{html.escape(human_bytes(base + bm.peak))}, {html.escape(human_bytes(bm.peak))} above its start</text>",
    ]
    for k, (a, b, mod) in enumerate(_bands(bm)):
        x0, x1 = left + pw * a / n, left + pw * (b + 1) / n
        out.append(
            f'<rect class="band" x="{x0:.1f}" y="{top}" width="{x1 - x0:.1f}" height="{ph}" '
            f'fill="{BAND_COLOURS[k % len(BAND_COLOURS)]}"><title>{html.escape(mod or "(no module)")}'
            f"</title></rect>"
        )
        if x1 - x0 > 7 * len(mod or "") + 6 and mod:
            out.append(
                f'<text x="{(x0 + x1) / 2:.1f}" y="{top + 14}" text-anchor="middle" fill="#666">'
                f"{html.escape(mod)}</text>"
            )
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#bbb"/>')
    for i in range(5):
        v = lo + span * i / 4
        out.append(
            f'<text x="{left - 6}" y="{Y(v - base) + 4:.1f}" text-anchor="end" fill="#555">'
            f"{html.escape(human_bytes(v))}</text>"
        )
    out.append(
        f'<line class="start" x1="{left}" x2="{left + pw}" y1="{Y(0):.1f}" y2="{Y(0):.1f}" stroke="#999" '
        f'stroke-dasharray="2 3"><title>alive when backward starts: {html.escape(human_bytes(base))}</title></line>'
    )
    if budget:
        y = Y(budget - bm.base)
        out.append(
            f'<line class="budget" x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#d62728" '
            f'stroke-dasharray="6 4"><title>budget {html.escape(human_bytes(budget))}</title></line>'
        )
    inner = " ".join(f"{X(i):.1f},{Y(v):.1f}" for i, v in enumerate(bm.inner))
    after = " ".join(f"{X(i):.1f},{Y(v):.1f}" for i, v in enumerate(bm.levels))
    out.append(
        f'<polyline class="inner" fill="none" stroke="#9ecae1" stroke-width="1" points="{inner}">'
        "<title>highest point inside each node (workspace included)</title></polyline>"
    )
    out.append(
        f'<polyline class="level" fill="none" stroke="#1f77b4" stroke-width="2" points="{after}">'
        "<title>bytes alive after each node</title></polyline>"
    )
    if bm.peak_node is not None:
        i = bm.order.index(bm.peak_node)
        out.append(
            f'<circle class="peak" cx="{X(i):.1f}" cy="{Y(bm.peak):.1f}" r="5" fill="#d62728">'
            f"<title>peak {html.escape(human_bytes(base + bm.peak))}: {html.escape(_where(bm))}</title></circle>"
        )
        anchor = "end" if X(i) > left + pw * 0.6 else "start"
        dx = -8 if anchor == "end" else 8
        out.append(
            f'<text class="peak-label" x="{X(i) + dx:.1f}" y="{Y(bm.peak) + 4:.1f}" text-anchor="{anchor}" '
            f'fill="#d62728">peak {html.escape(human_bytes(base + bm.peak))} at {html.escape(bm.names[i])}</text>'
        )
    out.append(f'<text x="{left}" y="{height - 14}" fill="#555">backward start</text>')
    out.append(
        f'<text x="{left + pw}" y="{height - 14}" text-anchor="end" fill="#555">end ({len(bm.order)} nodes)</text>'
    )
    out.append("</svg>")
    svg = "\n".join(out)
    if path is not None:
        Path(path).write_text(svg, encoding="utf-8")
    return svg


def repr_html(bm) -> str:
    """The notebook view: the curve, then the text."""
    return f"<div>{curve_svg(bm)}<pre>{html.escape(text(bm))}</pre></div>"
