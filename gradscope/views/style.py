"""The colours, labels, legend and DOT syntax helpers of the graph views.

The legend text is in :mod:`gradscope.views.render`.
"""

from __future__ import annotations

import re

from gradscope._format import human_bytes, shape_str

__all__ = ["COLORS", "esc", "label", "shade", "saved_lines", "short", "legend", "dot_id", "attrs"]

COLORS = {
    "param": "#dbeafe",
    "param_line": "#2563eb",
    "input": "#dcfce7",
    "input_line": "#16a34a",
    "op_line": "#475569",
    "group": "#ede9fe",
    "group_line": "#7c3aed",
    "finding": "#dc2626",
    "finding_fill": "#fee2e2",
    "edge": "#64748b",
    "shades": ("#ffffff", "#fff3e0", "#ffe0b2", "#ffb74d", "#fb8c00"),
}
_MAX_SAVED_LINES = 3


def esc(text) -> str:
    """Escape backslashes for a DOT string (graphviz quotes the rest)."""
    return str(text).replace("\\", "\\\\")


def label(lines) -> str:
    """A multi-line DOT label (centred lines); empty lines dropped."""
    return "\\n".join(esc(x) for x in lines if x)


def shade(nbytes: int, top: int) -> str:
    """White for nothing saved; then one shade per decade below the largest: >=50%, >=10%, >=1%, less."""
    shades = COLORS["shades"]
    if nbytes <= 0 or top <= 0:
        return shades[0]
    frac = nbytes / top
    return shades[4 if frac >= 0.5 else 3 if frac >= 0.1 else 2 if frac >= 0.01 else 1]


def saved_lines(saved) -> list[str]:
    """``slot: shape dtype bytes`` per saved tensor (at most three, then a ``+k more`` line)."""
    out = []
    for e in saved[:_MAX_SAVED_LINES]:
        status = e.get("status", "live")
        mark = " STALE" if status == "stale" else ("" if status == "live" else f" ({status})")
        out.append(
            f"{e['slot']}: {shape_str(e.get('shape'))} {e.get('dtype') or ''} {human_bytes(e.get('nbytes') or 0)}{mark}"
        )
    if len(saved) > _MAX_SAVED_LINES:
        rest = sum(e.get("nbytes") or 0 for e in saved[_MAX_SAVED_LINES:])
        out.append(f"+{len(saved) - _MAX_SAVED_LINES} more ({human_bytes(rest)})")
    return out


def short(name: str, cluster: str | None) -> str:
    return name[len(cluster) + 1 :] if cluster and name.startswith(cluster + ".") else name


def legend(dot):
    with dot.subgraph(name="cluster_legend") as c:
        c.attr(label="legend", style="rounded", color="#cbd5e1", id="cluster_legend")
        c.node("legend_param", "parameter", fillcolor=COLORS["param"], color=COLORS["param_line"])
        c.node("legend_input", "input", fillcolor=COLORS["input"], color=COLORS["input_line"])
        c.node("legend_op", "op (fill: saved bytes)", fillcolor=COLORS["shades"][3])
        c.node("legend_root", "root", peripheries="2", penwidth="2", fillcolor=COLORS["shades"][0])
        c.node(
            "legend_group",
            "collapsed / xN",
            shape="box3d",
            style="filled",
            fillcolor=COLORS["group"],
            color=COLORS["group_line"],
        )
        c.node("legend_finding", "finding", color=COLORS["finding"], penwidth="3", fillcolor=COLORS["shades"][0])
        c.node(
            "legend_stub",
            "shared leaf (one stub per use)",
            style="rounded,filled,dashed",
            fillcolor=COLORS["param"],
            color=COLORS["param_line"],
            fontsize="8",
        )


_ID = re.compile(r"[A-Za-z_][A-Za-z_0-9]*|-?(\.[0-9]+|[0-9]+(\.[0-9]*)?)")
_KEYWORDS = {"node", "edge", "graph", "digraph", "subgraph", "strict"}


def dot_id(text) -> str:
    """A DOT ID: bare when it is a plain identifier or number, else double-quoted."""
    text = str(text)
    if _ID.fullmatch(text) and text.lower() not in _KEYWORDS:
        return text
    return '"' + text.replace('"', '\\"') + '"'


def attrs(attrs: dict, sep: str = " ", bracket: bool = True) -> str:
    """``[label=... k=v ...]``: the label first, then the other keys sorted (deterministic)."""
    keys = (["label"] if "label" in attrs else []) + sorted(k for k in attrs if k != "label")
    text = sep.join(f"{k}={dot_id(attrs[k])}" for k in keys)
    return f" [{text}]" if bracket else text
