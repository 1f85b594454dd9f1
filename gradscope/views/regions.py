"""A ``torch.compile`` region drawn as a module box of its own ops, not one ``CompiledFunctionBackward`` node.

NOTE [compiled regions in the picture]
The walk stores, on a region's node, its backward graph's ops (``attrs["compiled"]``: op, module of the
forward op it differentiates, the user's line, the ops it reads) and which op makes each input's
gradient (walk/compiled.py). Before drawing, :func:`with_regions` copies the graph and adds one op node
per backward op (id ``nK~i``), with the module ``"<Class> (compiled).<module>"``: the views then draw
the region as a module cluster (boxed, folded and opened in the viewer like any module call) with the
model's own modules nested in it. Edges run in forward order, as everywhere in the picture: an op that
reads another's result in the backward comes before it in the forward. The region's node stays, inside
the box, as the region's output (where the gradient enters); each input's edge goes to the op that makes
its gradient. Nothing else reads these nodes: findings, memory and JSON keep the graph the walk made.
"""

from __future__ import annotations

from types import SimpleNamespace

__all__ = ["REGION", "box_name", "with_regions"]

#: Node attribute marking the nodes :func:`with_regions` drew for a region (their module is the box's).
REGION = "region"


def box_name(region: dict) -> str:
    """``"MLP (compiled)"``: the module box of a region named ``"MLP.forward"`` (no dot: a dot nests)."""
    name = region.get("name") or "region"
    base, _, extra = name.partition(" (")
    owner = base.split(".")[0] if "." in base else base
    extra = extra.rstrip(")").replace(".", "·")
    return f"{owner} (compiled{', ' + extra if extra else ''})"


def _regions(graph) -> list:
    out = []
    for n, d in graph.nodes(data=True):
        region = (d.get("attrs") or {}).get("compiled") if d.get("kind") == "op" else None
        if isinstance(region, dict) and region.get("ops"):
            out.append((n, region))
    return out


def with_regions(report):
    """``report``, or a report-like whose graph draws each readable compiled region as its ops."""
    graph = getattr(report, "graph", None)
    regions = _regions(graph) if graph is not None else []
    if graph is None or not regions:
        return report
    g = graph.copy()
    for n, region in regions:
        _expand(g, n, region)
    return SimpleNamespace(graph=g, findings=report.findings, saved_bytes=report.saved_bytes)


def _expand(g, n, region: dict) -> None:
    d = g.nodes[n]
    box = box_name(region)
    d.update({"module": box, REGION: True})
    ops = region["ops"]
    ids = [f"{n}~{i}" for i in range(len(ops))]
    for i, (op, module, line, reads) in enumerate(ops):
        g.add_node(
            ids[i], kind="op", name=op, module=f"{box}.{module}" if module else box, seq=d.get("seq"),
            saved_bytes=0, device=d.get("device"), root=False, opaque=False, saved=[], location=line,
            **{REGION: True},
        )  # fmt: skip
        for j in reads:
            g.add_edge(ids[i], ids[j], index=0, output=0)  # forward order: i's forward op ran first
    firsts = {int(k): v for k, v in (region.get("grads") or {}).items()}
    for i in [i for i, op in enumerate(ops) if not op[3]]:  # reads only saved tensors and the tangents:
        g.add_edge(ids[i], n, index=0, output=0)  # the last in forward order, next to the region's output
    edges = sorted(g.in_edges(n, data=True), key=lambda e: e[2].get("index", 0))
    for src, _, data in edges:
        k = data.get("index")
        if src not in ids and k in firsts:
            g.remove_edge(src, n)
            g.add_edge(src, ids[firsts[k]], **data)
