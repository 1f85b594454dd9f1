"""The terminal text of :meth:`Report.summary`."""

from __future__ import annotations

import textwrap

from gradscope._format import human_bytes, one_line, plural, shape_str
from gradscope.findings import severity_counts
from gradscope.graph import HELD, PARAMS, ROOT_SHAPES, ROOTS
from gradscope.graph.attribution import node_bytes, storage_uses

__all__ = ["summary", "top_nodes"]

_MARK = {"error": "x", "warning": "!", "info": "i"}


def top_nodes(graph, top: int) -> list[tuple[str, dict, int]]:
    """The ``top`` op nodes holding the most activation memory, largest first (ties by node id).

    Bytes are what each node's saved activations actually hold: each storage counted once, at its first
    saver (``memory.attribution.node_bytes``), parameters saved by reference left out. Returns
    ``(node id, attributes, bytes)`` triples.
    """
    own = node_bytes(graph)
    ops = [(n, graph.nodes[n], b) for n, b in own.items() if b > 0]
    ops.sort(key=lambda t: (-t[2], int(t[0][1:]) if t[0][1:].isdigit() else 0))
    return ops[:top]


def _activation_slots(graph, nid: str, d: dict, owner: dict) -> str:
    """``slot shape`` of the saved tensors whose storage this node is the owner of."""
    params = {p["storage"] for p in graph.graph.get(PARAMS, {}).values() if p.get("storage") is not None}
    return ", ".join(
        f"{e['slot']} {shape_str(e['shape'])}"
        for e in d["saved"]
        if e["status"] in HELD
        and not e.get("scalar")
        and e.get("storage") not in params
        and owner.get(e.get("storage"), nid) == nid
    )


def summary(report, top: int = 5) -> str:
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        from gradscope.errors import InputValueError

        raise InputValueError(
            f"summary(top=...) must be a non-negative int (rows of the memory table), got {one_line(top)}."
        )
    g = report.peek_graph()  # the compact graph until report.graph is read: same answers, no DiGraph built
    kinds = {"op": 0, "param": 0, "input": 0}
    kind_of = dict(g.nodes(data="kind"))
    for k in kind_of.values():
        kinds[k] = kinds.get(k, 0) + 1
    compact = getattr(g, "compact", None)
    saved_count = (
        compact.n_slots_total() if compact is not None else sum(len(d["saved"]) for _, d in g.nodes(data=True))
    )
    lines = [
        f"gradscope: {g.number_of_nodes()} nodes ({kinds['op']} ops, {kinds['param']} parameters, "
        f"{kinds['input']} inputs), {human_bytes(report.saved_bytes)} held by {plural(saved_count, 'saved tensor')}",
    ]
    acts = sum(node_bytes(g).values())
    if acts != report.saved_bytes:
        lines[0] += (
            f" ({human_bytes(acts)} activations + {human_bytes(report.saved_bytes - acts)} parameters "
            "saved by reference)"
        )
    roots = [
        f"{g.nodes[r]['name']} ({shape_str(s)})" for r, s in zip(g.graph.get(ROOTS, ()), g.graph.get(ROOT_SHAPES, ()))
    ]
    lines.append("root: " + ", ".join(roots))
    params = g.graph.get(PARAMS, {})
    if params:
        trainable = sum(1 for p in params.values() if p["requires_grad"])
        reached = sum(1 for p in params.values() if p["requires_grad"] and p.get("node") is not None)
        lines.append(f"parameters: {reached}/{trainable} trainable reached, {len(params) - trainable} frozen")
    lines.append("")
    regions = [n for n, d in g.nodes(data=True) if (d.get("function") or "").endswith("CheckpointFunction")]
    if not report.findings and regions:  # what their recomputation does in backward() is not seen
        lines.append(
            f"No findings outside {len(regions)} reentrant checkpoint region(s): backward() re-runs "
            "them with grad enabled, where an in-place write can still make it raise; gradscope "
            "checks checkpoint(..., use_reentrant=False) fully."
        )
    elif not report.findings:
        lines.append("No findings: backward() will run and every trainable parameter gets a gradient.")
    else:
        lines.append("Findings: " + severity_counts(report.findings))
        for f in report.findings:
            head = f"  [{_MARK.get(f.severity, '?')}] {f.severity:<7} {f.kind}"
            if f.node is not None:
                head += f"  at {f.node} ({g.nodes[f.node]['name']})" if f.node in g else f"  at {f.node}"
            if f.location:
                head += f"  {f.location}"
            lines.append(head)
            lines.extend(textwrap.wrap(f.message, width=96, initial_indent="        ", subsequent_indent="        "))
    hot = top_nodes(g, top)
    if hot:
        uses = storage_uses(g)
        owner = {u.key[1]: u.owner for u in uses if u.key[0] == "s"}
        by_ref = sum(u.nbytes for u in uses if u.category == "params")
        lines.append("")
        lines.append(f"Top saved memory (activations, each storage once; {len(hot)} of {len(kind_of)} nodes):")
        for nid, d, nbytes in hot:
            where = f" in {d['module']}" if d.get("module") else ""
            where += f" ({d['location']})" if d.get("location") else ""  # traced: the line that made it
            slots = _activation_slots(g, nid, d, owner)
            lines.append(f"  {human_bytes(nbytes):>10}  {nid:<6} {d['name']}{where}: {slots}")
        if by_ref:
            lines.append(f"  (plus {human_bytes(by_ref)} of parameters saved by reference: no extra memory)")
    if any(m for n, m in g.nodes(data="module") if kind_of[n] == "op"):
        from gradscope.graph.attribution import module_bytes

        mods = [(m, n) for m, n in module_bytes(g, params=False).items() if n > 0][:top]
        if mods:
            lines.append(
                "Saved memory by module (activations; see report.memory()): "
                + ", ".join(f"{m} {human_bytes(n)}" for m, n in mods)
            )
    return "\n".join(lines)
