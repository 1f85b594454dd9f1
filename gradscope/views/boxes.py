"""The part of a report the navigating views draw when one box is opened.

See :func:`gradscope.views.render.drawing` (``box=``).
"""

from __future__ import annotations

from types import SimpleNamespace

from gradscope._format import one_line
from gradscope.errors import InputValueError
from gradscope.graph import CALLED_MODULES, held_bytes

__all__ = ["box_part"]


def box_part(report, box, within, collapse, fold):
    """The part of ``report`` inside the box ``box`` ("fold:nK", "module:NAME"), with context stubs."""
    from gradscope.views.collapse import infer_modules

    graph = report.graph
    view = within.view
    grp = view.groups.get(box) if view is not None else None
    if grp is None and box.startswith("module:"):
        name = box[len("module:") :]
        mods = infer_modules(graph)
        members = [n for n, m in mods.items() if m == name or (m or "").startswith(name + ".")]
        members += [
            n for n in graph if graph.nodes[n]["kind"] != "op" and any(s in set(members) for s in graph.successors(n))
        ]
        kind, reps = "module", 1
    elif grp is None:
        raise InputValueError(
            f"no box {one_line(box)} in the drawing; its boxes are "
            f"{', '.join(view.groups) if view and view.groups else '(none)'}."
        )
    else:
        members, kind, reps = list(grp.members), grp.kind, grp.reps
    mods = view.module_of if view is not None else infer_modules(graph)
    if kind == "fold":  # one repetition: the others run the same ops
        ops = [n for n in members if graph.nodes[n]["kind"] == "op"]
        ops.sort(key=lambda n: (graph.nodes[n].get("seq") or 0, n))
        first = set(ops[: max(1, len(ops) // max(reps, 1))])
        members = [
            n
            for n in members
            if n in first or (graph.nodes[n]["kind"] != "op" and any(s in first for s in graph.successors(n)))
        ]
        fold = False if fold is None else fold
    inside = set(members)
    inside |= {
        p
        for n in list(inside)
        if graph.nodes[n]["kind"] == "op"
        for p in graph.predecessors(n)
        if graph.nodes[p]["kind"] != "op"
    }  # the parameters the ops read, even if shared
    context = {
        v
        for n in inside
        if graph.nodes[n]["kind"] == "op"
        for v in list(graph.predecessors(n)) + list(graph.successors(n))
        if v not in inside and graph.nodes[v]["kind"] == "op"
    }
    sub = graph.subgraph(inside | context).copy()
    sub.graph = {k: v for k, v in graph.graph.items() if k == CALLED_MODULES}
    sub.graph["context"] = sorted(context)
    for n in context:
        sub.nodes[n]["root"] = False
    module_of = {n: (None if n in context else mods.get(n)) for n in sub}
    findings = [f for f in report.findings if f.node in inside]
    part = SimpleNamespace(graph=sub, findings=findings, saved_bytes=held_bytes(graph, members))
    return part, module_of, collapse, fold
