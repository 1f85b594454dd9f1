"""The terminal text of :meth:`Report.summary`."""

from __future__ import annotations

import textwrap

from gradscope.walk.saved import HELD
from gradscope._format import human_bytes, one_line, shape_str

__all__ = ["summary", "top_nodes"]

_MARK = {"error": "x", "warning": "!", "info": "i"}


def top_nodes(graph, top: int) -> list[tuple[str, dict]]:
    """The ``top`` op nodes holding the most saved bytes, largest first (ties by node id)."""
    ops = [(n, d) for n, d in graph.nodes(data=True) if d["saved_bytes"] > 0]
    ops.sort(key=lambda nd: (-nd[1]["saved_bytes"], int(nd[0][1:]) if nd[0][1:].isdigit() else 0))
    return ops[:top]


def summary(report, top: int = 5) -> str:
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        from gradscope.errors import InputValueError
        raise InputValueError(f"summary(top=...) must be a non-negative int (rows of the memory table), got "
                              f"{one_line(top)}.")
    g = report.graph
    kinds = {"op": 0, "param": 0, "input": 0}
    saved_count = 0
    for _, d in g.nodes(data=True):
        kinds[d["kind"]] = kinds.get(d["kind"], 0) + 1
        saved_count += len(d["saved"])
    lines = [
        f"gradscope: {g.number_of_nodes()} nodes ({kinds['op']} ops, {kinds['param']} parameters, "
        f"{kinds['input']} inputs), {human_bytes(report.saved_bytes)} held by {saved_count} saved tensors",
    ]
    roots = [f"{g.nodes[r]['name']} ({shape_str(s)})"
             for r, s in zip(g.graph.get("roots", ()), g.graph.get("root_shapes", ()))]
    lines.append("root: " + ", ".join(roots))
    params = g.graph.get("params", {})
    if params:
        trainable = sum(1 for p in params.values() if p["requires_grad"])
        reached = sum(1 for p in params.values() if p["requires_grad"] and p.get("node") is not None)
        lines.append(f"parameters: {reached}/{trainable} trainable reached, "
                     f"{len(params) - trainable} frozen")
    lines.append("")
    regions = [n for n, d in g.nodes(data=True) if (d.get("function") or "").endswith("CheckpointFunction")]
    if not report.findings and regions:   # what their recomputation does in backward() is not seen
        lines.append(f"No findings outside {len(regions)} reentrant checkpoint region(s): backward() re-runs "
                     "them with grad enabled, where an in-place write can still make it raise; gradscope "
                     "checks checkpoint(..., use_reentrant=False) fully.")
    elif not report.findings:
        lines.append("No findings: backward() will run and every trainable parameter gets a gradient.")
    else:
        counts = {}
        for f in report.findings:
            counts[f.severity] = counts.get(f.severity, 0) + 1
        lines.append("Findings: " + ", ".join(f"{n} {s}{'s' if n > 1 else ''}" for s, n in counts.items()))
        for f in report.findings:
            head = f"  [{_MARK.get(f.severity, '?')}] {f.severity:<7} {f.kind}"
            if f.node is not None:
                head += f"  at {f.node} ({g.nodes[f.node]['name']})" if f.node in g else f"  at {f.node}"
            if f.location:
                head += f"  {f.location}"
            lines.append(head)
            lines.extend(textwrap.wrap(f.message, width=96, initial_indent="        ",
                                       subsequent_indent="        "))
    hot = top_nodes(g, top)
    if hot:
        lines.append("")
        lines.append(f"Top saved memory ({len(hot)} of {sum(1 for _ in g.nodes)} nodes):")
        for nid, d in hot:
            where = f" in {d['module']}" if d.get("module") else ""
            slots = ", ".join(f"{e['slot']} {shape_str(e['shape'])}" for e in d["saved"]
                              if e["status"] in HELD)
            lines.append(f"  {human_bytes(d['saved_bytes']):>10}  {nid:<6} {d['name']}{where}: {slots}")
    if any(d.get("module") for _, d in g.nodes(data=True) if d["kind"] == "op"):
        from gradscope.memory.attribution import module_bytes

        mods = [(m, n) for m, n in module_bytes(g, params=False).items() if n > 0][:top]
        if mods:
            lines.append("Saved memory by module (activations; see report.memory()): "
                         + ", ".join(f"{m} {human_bytes(n)}" for m, n in mods))
    return "\n".join(lines)
