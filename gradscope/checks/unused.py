"""``unused-parameter`` and ``detached-branch``: parameters whose ``.grad`` will stay None."""

from __future__ import annotations

from collections.abc import Iterator

from gradscope.checks._nodes import node_items
from gradscope.findings import Finding
from gradscope.graph import CALLED_MODULES, EVENTS, PARAMS

__all__ = ["check", "opaque_nodes", "describe_cut", "cuts_by_param"]

_CUT_WORDS = {
    "detach": "cut by .detach()",
    ".data": "cut by .data (which bypasses autograd)",
    "no_grad": "computed under torch.no_grad()/inference_mode",
    "to-python": "turned into a Python value (.item()/.tolist()/.numpy())",
    "non-differentiable": "passed through an op without a gradient (an integer/boolean result such as "
                          "argmax, a comparison or .long())",
}


def opaque_nodes(graph, nodes=None) -> list[str]:
    """Node ids of opaque regions (custom Functions, reentrant checkpoint, compiled code)."""
    return [n for n, d in node_items(graph, nodes) if d["kind"] == "op" and (d.get("opaque") or d.get("function"))]


def check(graph, nodes=None) -> Iterator[Finding]:
    """Parameters that require grad but no path from the roots reaches."""
    params = graph.graph.get(PARAMS, {})
    missing = [name for name, p in params.items() if p["requires_grad"] and p.get("node") is None]
    if not missing:
        return
    cuts = cuts_by_param(graph)
    called = graph.graph.get(CALLED_MODULES)
    opaque = opaque_nodes(graph, nodes)
    plain: list[str] = []
    by_cut: dict = {}   # one finding per cut: every parameter it drops
    for name in missing:
        if name in cuts:
            ev = cuts[name]
            by_cut.setdefault((ev["kind"], ev["op"], ev["location"]), (ev, []))[1].append(name)
        else:
            plain.append(name)
    for ev, names in by_cut.values():
        yield _detached(ev, names, opaque, graph)
    if opaque and plain:  # one warning: the walk cannot tell which of them the opaque region uses
        yield _unused(None, plain, False, opaque, graph)
        return
    for module, names in _group(plain):
        never = called is not None and module is not None and module not in called
        yield _unused(module, names, never, opaque, graph)


def describe_cut(ev: dict) -> str:
    """``"cut by .detach() at model.py:42"``: what a trace event did and where (op named when it adds)."""
    words = _CUT_WORDS.get(ev["kind"], ev["kind"])
    op = f" ({ev['op']})" if ev["op"] not in words else ""   # "cut by .detach()", not "... (detach)"
    where = f"at {ev['location']}" if ev.get("location") else "at an unknown location"
    return f"{words}{op} {where}"


def _detached(ev, names, opaque, graph) -> Finding:
    subject = ", ".join(names) if len(names) <= 4 else f"{len(names)} parameters ({names[0]}, {names[1]}, ...)"
    cut = describe_cut(ev)
    them = "it" if len(names) == 1 else "them"
    fix = f"Remove the cut, or freeze {them} (requires_grad_(False)) if that is intended."
    if opaque:  # they may also be used inside an opaque region, which the walk cannot see
        return Finding(
            "detached-branch", "warning",
            f"{subject} {'is' if len(names) == 1 else 'are'} not reachable from the root: the branch was "
            f"{cut}, but the graph holds {len(opaque)} opaque node(s) (first: "
            f"{graph.nodes[opaque[0]]['name']}) that may use {them} (reentrant checkpoint, custom "
            "Function); check after backward() whether .grad is None. " + fix,
            params=tuple(names), location=ev["location"])
    return Finding("detached-branch", "error",
                   f"{subject} {'gets' if len(names) == 1 else 'get'} no gradient: the branch was {cut}. "
                   f"{fix}", params=tuple(names), location=ev["location"])


def _unused(module, names, never_called, opaque, graph) -> Finding:
    if len(names) <= 3:
        subject = ", ".join(names)
    else:
        subject = f"{len(names)} parameters of {module or 'the model'} ({names[0]}, {names[1]}, ...)"
    if never_called:
        why = f"module {module} was never called in the forward pass"
    else:
        why = "no path from the root reaches them"
    fix = ("Use the module in forward(), freeze it (requires_grad_(False)), or pass "
           "find_unused_parameters=True to DDP if it is legitimately skipped on some steps.")
    if opaque:
        first = graph.nodes[opaque[0]]
        return Finding(
            "unused-parameter", "warning",
            f"{subject}: {why}, but the graph holds {len(opaque)} opaque node(s) (first: {first['name']}) "
            "that may use parameters the walk cannot see (reentrant checkpoint, custom Function, compiled "
            "region); check after backward() whether .grad is None. " + fix,
            node=None, params=tuple(names))
    return Finding("unused-parameter", "error",
                   f"{subject} will get no gradient (.grad stays None): {why}. {fix}",
                   params=tuple(names))


def _group(names: list[str]):
    groups: dict = {}
    for n in names:
        groups.setdefault(n.rpartition(".")[0] or None, []).append(n)
    return list(groups.items())


def cuts_by_param(graph) -> dict:
    """Parameter name -> the first trace event (a cut, not an in-place op) that names it."""
    out: dict = {}
    for ev in graph.graph.get(EVENTS, ()):
        if ev["kind"] == "inplace":
            continue
        for p in ev.get("params", ()):
            out.setdefault(p, ev)
    return out
