"""The drawn elements: one box per op, per group (fold, chain, collapsed module call) and per input or parameter.

Functions over :class:`gradscope.views.dot._Builder` (``b``): they read the graph and the view and add elements.
"""

from __future__ import annotations

from gradscope._format import human_bytes, plural, shape_str
from gradscope.findings import INPLACE_HAZARD
from gradscope.views.collapse import depth, fold_lines, truncate
from gradscope.views.style import COLORS, esc
from gradscope.views.style import label as _label
from gradscope.views.style import saved_lines as _saved_lines
from gradscope.views.style import shade as _shade
from gradscope.views.style import short as _short

__all__ = ["op", "group", "leaf", "first_op"]


def first_op(b, grp):
    """The first op of group ``grp`` in forward order (its calls decide the group's cluster)."""
    ops = [m for m in grp.members if b.g.nodes[m]["kind"] == "op"]
    return min(ops, key=lambda m: (b.g.nodes[m].get("seq") or -1, m)) if ops else None


def op(b, n, d, top) -> None:
    """Draw op node ``n`` (attributes ``d``): its name, output shape, saved tensors, findings; ``top`` is the
    largest activation size (the shading's scale)."""
    lines = [d["name"]]
    outs = d.get("out_shapes") or []
    if d.get("root"):
        lines.append("root -> " + ", ".join(shape_str(s) for s in d.get("root_shapes") or outs[:1]))
    elif outs and not b.compact:
        lines.append("-> " + shape_str(outs[0]))
    own = b.own.get(n, 0)
    if b.show_saved and d["saved"]:
        lines += _saved_lines(d["saved"])
    if own and not b.compact:
        lines.append(f"holds {human_bytes(own)}")
    for f in b.flagged.get(n, ()):  # an in-place write: its line (trace()), where the fix goes
        lines.append(f"!! {f.kind}")
        if f.kind == INPLACE_HAZARD and f.location:
            lines.append(f"written in place at {f.location}")
    if d.get("planned"):  # set by Plan.render(): the module is checkpointed / offloaded
        lines.append(f"plan: {d['planned']}")
    classes = ["gs-op"] + (["gs-root"] if d.get("root") else []) + (["gs-planned"] if d.get("planned") else [])
    attrs: dict[str, str] = {"fillcolor": _shade(own, top)}
    if d.get("memory_peak"):  # set by BackwardMemory.render(): backward's memory peak is here
        lines.append(d["memory_peak"])
        classes.append("gs-memory-peak")
        attrs.update(color=str(COLORS["finding"]), penwidth="3")
    if d.get("root"):
        attrs.update(peripheries="2", penwidth="2")
    if n in b.context:
        lines = [f"{'from' if b.g.out_degree(n) else 'to'} {n} {d['name']}"]
        classes.append("gs-context")
        attrs.update(style="rounded,dashed", fontsize="8", fillcolor="#ffffff")
    params = [b.g.nodes[p]["name"] for p in b.g.predecessors(n) if b.g.nodes[p]["kind"] == "param"]
    info = {
        "kind": "op",
        "name": d["name"],
        "op": d["name"],
        "node": n,
        "module": b.view.module_of.get(n),
        "params": params,
        "bytes": human_bytes(own),
        "held": own,
        "by_reference": b.by_ref.get(n, 0),
        "context": n in b.context,
        "saved": _saved_lines(d["saved"]) if d["saved"] else [],
    }
    if d.get("location"):  # traced: the user's line that made the node (viewer panel, SVG tooltip)
        info["location"] = d["location"]
        attrs["tooltip"] = esc(f"{n} {d['name']} at {d['location']}")
    b.add(n, b.cluster_of_node(n), _label(lines), classes, info, **attrs)
    b.out.element_of[n] = n


def group(b, gid, grp, top) -> None:
    """Draw one box for group ``gid`` of the view: a fold (``xN``), a chain, or a collapsed module call."""
    if grp.kind == "fold":
        lines = fold_lines(grp)
        cluster = b.call_key(grp.module, first_op(b, grp))
    elif grp.kind == "chain":
        lines = [
            f"{grp.title}: "
            + ", ".join(x.replace("Backward0", "") for x in grp.pattern[:4])
            + (", ..." if len(grp.pattern) > 4 else "")
        ]
        cluster = b.call_key(grp.module, first_op(b, grp))
    else:
        cluster = b.call_key(truncate(grp.module, depth(grp.module) - 1), first_op(b, grp))
        named = grp.title if b.compact or b.clusters is False else _short(grp.title, cluster)
        if named.split(".")[0].isdigit():  # "layers.1", not "1", inside the cluster "layers"
            named = ".".join(grp.title.split(".")[-2 - named.count(".") :])
        call = gid.rpartition("#")[2] if "#" in gid else None
        lines = [f"{named}  (collapsed{', call ' + call if call else ''})"]
    lines.append(f"{plural(grp.n_ops, 'op')}, {human_bytes(grp.saved_bytes)} saved")
    if grp.worst is not None:
        lines.append(f"!! {grp.worst.kind}")
    classes, marks = ["gs-group", f"gs-{grp.kind}"], {}
    members = [b.g.nodes[m] for m in grp.members]
    planned = sorted({d["planned"] for d in members if d.get("planned")})  # Plan.render() (see op())
    if planned:
        lines.append("plan: " + ", ".join(planned))
        classes.append("gs-planned")
    peak = next((d["memory_peak"] for d in members if d.get("memory_peak")), None)  # BackwardMemory.render()
    if peak:
        lines.append(peak)
        classes.append("gs-memory-peak")
        marks = {"color": COLORS["finding"], "penwidth": "3"}
    info = {
        "kind": grp.kind,
        "name": grp.title,
        "group": gid,
        "module": grp.module,
        "ops": grp.n_ops,
        "bytes": human_bytes(grp.saved_bytes),
        "held": grp.saved_bytes,
        "members": len(grp.members),
        "reps": grp.reps,
        "expandable": True,
        "params": sorted({b.g.nodes[m]["name"] for m in grp.members if b.g.nodes[m]["kind"] == "param"}),
        "op_names": sorted({b.g.nodes[m]["name"] for m in grp.members if b.g.nodes[m]["kind"] == "op"}),
        "pattern": list(grp.pattern[:12]),
        "worst": grp.worst.message if grp.worst else None,
    }
    shade = _shade(grp.saved_bytes, top)
    fill = COLORS["group"] if shade == COLORS["shades"][0] else shade
    b.add(
        gid,
        cluster,
        _label(lines),
        classes,
        info,
        shape="box3d",
        margin="0.14,0.05",
        style="filled",
        fillcolor=fill,
        **{"color": COLORS["group_line"], **marks},
    )


def leaf(b, n, d) -> None:
    """Draw input/parameter ``n`` beside the one element it feeds, or one stub per user when it is shared."""
    kind = d["kind"]
    users = list(dict.fromkeys(b.out.element_of[c] for c in b.g.successors(n)))
    base = {"fillcolor": COLORS[kind], "color": COLORS[kind + "_line"]}
    info = {
        "kind": kind,
        "name": d["name"],
        "node": n,
        "module": d.get("module"),
        "params": [d["name"]] if kind == "param" else [],
        "shape": shape_str(d.get("shape")),
        "dtype": d.get("dtype"),
        "bytes": "0 B",
        "saved": [],
    }
    if len(users) <= 1:
        cluster = b.cluster_of(users[0]) if users else None
        lines = [
            _short(d["name"], cluster) if kind == "param" else d["name"],
            f"{shape_str(d.get('shape'))} {d.get('dtype') or ''}",
        ]
        classes = [f"gs-{kind}"]
        if d.get("root"):  # inspect(leaf): the root is the leaf itself
            classes.append("gs-root")
            base.update(peripheries="2", penwidth="2")
        b.add(n, cluster, _label(lines), classes, info, **base)
        b.out.element_of[n] = n
        for u in users:
            b.edge(n, u)
            b.beside[n] = u
        return
    for i, u in enumerate(users):
        sid = f"{n}~{i}"
        cluster = b.cluster_of(u)
        label = _label([_short(d["name"], cluster), f"shared x{b.g.out_degree(n)}"])
        b.add(
            sid,
            cluster,
            label,
            [f"gs-{kind}", "gs-stub", f"gs-of-{n}"],
            info,
            fontsize="8",
            style="rounded,filled,dashed",
            **base,
        )
        b.edge(sid, u)
        b.beside[sid] = u
    b.out.element_of[n] = f"{n}~0"
