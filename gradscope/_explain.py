"""The text of :meth:`Report.explain`: one parameter's story."""

from __future__ import annotations

import difflib

from .errors import UnknownParameterError
from .checks.unused import opaque_nodes

__all__ = ["explain"]


def explain(report, param: str) -> str:
    g = report.graph
    params = g.graph.get("params", {})
    if not isinstance(param, str):
        raise UnknownParameterError(f"explain() takes a parameter name (str), got {type(param).__name__}.")
    info = params.get(param)
    if info is None:
        if not params:
            raise UnknownParameterError(
                f"{param!r} is not a known parameter: inspect() was called without model= or params=, "
                "so parameters have no names. Pass model=your_model.")
        close = difflib.get_close_matches(param, list(params), n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise UnknownParameterError(f"{param!r} is not a parameter of the inspected model.{hint}")
    if not info["requires_grad"]:
        return (f"{param} is frozen (requires_grad=False): it gets no gradient on purpose, and gradscope "
                "never flags it.")
    nid = info.get("node")
    if nid is not None:
        users = sorted(g.successors(nid), key=lambda n: int(n[1:]))
        ops = ", ".join(f"{g.nodes[u]['name']} ({u}{_in(g.nodes[u])})" for u in users[:4])
        more = f" and {len(users) - 4} more" if len(users) > 4 else ""
        text = f"{param} is reached from the root: it feeds {ops}{more}, so backward() gives it a gradient."
        blockers = [f for f in report.findings if f.kind == "inplace-hazard"]
        if blockers:
            text += (f" But backward() will raise first: {len(blockers)} in-place hazard(s), see "
                     f"{blockers[0].node}.")
        return text
    for f in report.findings:
        if param in f.params:
            if f.kind == "detached-branch":
                return f.message
            if f.kind == "unused-parameter":
                return f"{param}: " + f.message if len(f.params) > 1 else f.message
    opaque = opaque_nodes(g)
    if opaque:
        return (f"{param} is not reachable by the walk, but it may be used inside the opaque node "
                f"{g.nodes[opaque[0]]['name']} ({opaque[0]}); check .grad after backward().")
    return f"{param} is not reachable from the root: its .grad will stay None."


def _in(d) -> str:
    return f" in {d['module']}" if d.get("module") else ""
