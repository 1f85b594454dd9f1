"""The text of :meth:`Report.explain`: one parameter's story.

The answer is one of: frozen, reached (through which module and op), cut (by what, where: needs
``trace()``), unused (its module never ran, or ran but its output never reached the root), or possibly
hidden inside an opaque node. It reads only the metadata graph, so it works on a report loaded from JSON.
"""

from __future__ import annotations

import difflib

from gradscope._format import one_line
from gradscope._wrappers import user_name
from gradscope.checks import compiled
from gradscope.checks.unused import (
    checkpoint_inputs,
    checkpointed,
    cut_fix,
    cuts_by_param,
    describe_cut,
    opaque_nodes,
    skipped_by,
)
from gradscope.errors import UnknownParameterError
from gradscope.findings import INPLACE_HAZARD
from gradscope.graph import CALLED_MODULES, PARAMS

__all__ = ["explain"]

_FIX_CUT = "Remove the cut, or freeze the parameter (requires_grad_(False)) if that is intended."


def explain(report, param: str) -> str:
    """Why ``param`` gets (or does not get) a gradient; see :meth:`gradscope.Report.explain`."""
    g = report.graph
    params = g.graph.get(PARAMS, {})
    if not isinstance(param, str):
        raise UnknownParameterError(f"explain() takes a parameter name (str), got {type(param).__name__}.")
    info = params.get(param)
    if info is None and user_name(param) in params:  # "_orig_mod.a.weight" names the user's "a.weight"
        param = user_name(param)
        info = params[param]
    if info is None:
        if not params:
            raise UnknownParameterError(
                f"{one_line(param)} is not a known parameter: inspect() was called without model= or params=, "
                "so parameters have no names. Pass model=your_model."
            )
        close = difflib.get_close_matches(param, list(params), n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise UnknownParameterError(f"{one_line(param)} is not a parameter of the inspected model.{hint}")
    if not info["requires_grad"]:
        return f"{param} is frozen (requires_grad=False): it gets no gradient on purpose, and gradscope never flags it."
    if info.get("node") is not None:
        return _reached(report, param, info["node"])
    inside = checkpointed(g)
    if inside is not None and param in inside:
        region = inside[param]
        passed = checkpoint_inputs(g).get(param) if region is None else None
        if passed is not None:
            return _cut(g, param, passed)
        if region is None:
            return (
                f"{param} is used only inside a reentrant checkpoint region whose inputs do not require "
                "grad, so the region's output is cut from the graph and .grad stays None. Make an input "
                "of the region require grad, or use checkpoint(..., use_reentrant=False)."
            )
        return (
            f"{param} is used inside the reentrant checkpoint region {g.nodes[region]['name']} ({region}):"
            " backward() re-runs the region and gives it a gradient (the walk alone cannot see it)."
        )
    cut = cuts_by_param(g).get(param)
    if cut is not None:
        return _cut(g, param, cut)
    opaque = opaque_nodes(g) if inside is None else []
    if opaque:
        return (
            f"{param} is not reachable by the walk, but it may be used inside the reentrant checkpoint "
            f"region {g.nodes[opaque[0]]['name']} ({opaque[0]}); check .grad after backward(), or record "
            "the forward with gradscope.trace() to know."
        )
    return _unused(g, param)


def _reached(report, param: str, nid: str) -> str:
    g = report.graph
    users = sorted(g.successors(nid), key=_order)
    ops = ", ".join(f"{g.nodes[u]['name']} ({u}{_in(g.nodes[u])})" for u in users[:4])
    more = f" and {len(users) - 4} more" if len(users) > 4 else ""
    modules = sorted({g.nodes[u]["module"] for u in users if g.nodes[u].get("module")})
    through = f" through {', '.join(modules)}" if modules else ""
    text = f"{param} is reached from the root{through}: it feeds {ops}{more}, so backward() gives it a gradient."
    unread = compiled.unread_regions(g, users)
    if unread:
        n, region = unread[0]
        text += (
            f" But it is read inside the torch.compile region {region.get('name') or n}, which is not "
            f"readable ({region['why']}): whether that region sends it a gradient is not known. "
            f"{compiled.UNREAD_FIX}."
        )
    blockers = [f for f in report.findings if f.kind == INPLACE_HAZARD]
    if blockers:
        where = f" by {blockers[0].location}" if blockers[0].location else ""
        text += (
            f" But backward() will raise first: {len(blockers)} in-place hazard(s), the first at "
            f"{blockers[0].node}{where}."
        )
    return text


def _cut(g, param: str, ev: dict) -> str:
    inside = f" inside {ev['module']}" if ev.get("module") else ""
    params = g.graph[PARAMS]
    others = [p for p in ev.get("params", ()) if p != param and params.get(p, {}).get("node") is None]
    also = f" The same cut also drops {_list(others)}." if others else ""
    return (
        f"{param} gets no gradient (.grad stays None): its branch was {describe_cut(ev)}"
        f"{inside}, so no path from the root reaches it.{also} {cut_fix(ev) or _FIX_CUT}"
    )


def _unused(g, param: str) -> str:
    module = param.rpartition(".")[0] or None
    called = g.graph.get(CALLED_MODULES)
    fix = "Use it in forward(), or freeze it (requires_grad_(False)) if it is not meant to train."
    if called is not None and module is not None:
        if module not in called:
            return (
                f"{param} gets no gradient (.grad stays None): it is not used by this forward, its module "
                f"{module} was never called in the forward pass ({skipped_by(module, called)}). {fix}"
            )
        return (
            f"{param} gets no gradient (.grad stays None): its module {module} ran in the forward pass, "
            f"but nothing it computed reaches the root (its output was dropped or overwritten). {fix}"
        )
    hint = "" if called is not None else " Record the forward with gradscope.trace() to learn where it was lost."
    return f"{param} is not reachable from the root: its .grad will stay None. {fix}{hint}"


def _list(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _order(nid: str):
    return (0, int(nid[1:])) if nid[1:].isdigit() else (1, nid)


def _in(d) -> str:
    return f" in {d['module']}" if d.get("module") else ""
