"""``unused-parameter`` and ``detached-branch``: parameters whose ``.grad`` will stay None.

NOTE [what can hide a parameter]
A parameter that no path from the roots reaches gets no gradient, with one exception: a reentrant
``checkpoint`` (``CheckpointFunction``) re-runs its body in backward() and sends gradients to the
parameters that body used, which are not inputs of its node. Nothing else hides one: a custom
``autograd.Function`` can only return gradients for its own inputs (visible edges), a ``torch.compile``
region receives every parameter it uses as an input of its node, and the wrappers that
``register_full_backward_hook`` installs (Captum, Grad-CAM) are custom Functions over the module's
inputs and outputs. So only reentrant checkpoints lower "unused" to a warning, and only untraced: with
``trace()`` the parameters the checkpoint bodies used are known (``graph.graph[CHECKPOINT_PARAMS]``,
name -> the sequence numbers of the regions' nodes, which the graph holds or not).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

from gradscope.checks._nodes import node_items
from gradscope.findings import DETACHED_BRANCH, ERROR, UNUSED_PARAMETER, WARNING, Finding
from gradscope.graph import CALLED_MODULES, CHECKPOINT_PARAMS, EVENTS, PARAMS, ROOTS

__all__ = [
    "check",
    "skipped_by",
    "opaque_nodes",
    "describe_cut",
    "cut_fix",
    "cuts_by_param",
    "checkpointed",
    "checkpoint_inputs",
]

_CUT_WORDS = {
    "detach": "cut by .detach()",
    ".data": "cut by .data (which bypasses autograd)",
    "no_grad": "computed under torch.no_grad()/inference_mode",
    "to-python": "turned into a Python value (.item()/.tolist()/.numpy())",
    "non-differentiable": "passed through an op without a gradient (a comparison, argmax, or a cast to an "
    "integer/boolean type)",
}
_COPY_OPS = {
    "tensor": "copied by torch.tensor(), which makes a new leaf without the graph (use the tensor "
    "itself, torch.stack()/torch.cat() of the tensors, or .clone() to copy it)",
    "new_tensor": "copied by Tensor.new_tensor(), which makes a new leaf without the graph (use the "
    "tensor itself, or .to()/.clone() for another dtype or a copy)",
    "as_tensor": "copied by torch.as_tensor(), which drops the graph (use torch.stack()/torch.cat() of the tensors)",
    "asarray": "copied by torch.asarray(), which drops the graph",
    "Parameter": "wrapped in a new leaf by nn.Parameter(), which detaches the tensor it is given (use the "
    "computed tensor itself; make a Parameter once, in __init__, for a weight that should train)",
}
# When several recorded events fed the same parameters, the one that severed the path is the strongest
# kind: a comparison or .item() next to a real .detach() is usually a logged value or a mask.
_RANK = {"detach": 0, ".data": 0, "no_grad": 1, "non-differentiable": 2, "to-python": 3}


def opaque_nodes(graph, nodes=None) -> list[str]:
    """Node ids of the regions that can hide parameters: reentrant checkpoints (NOTE above)."""
    return [
        n
        for n, d in node_items(graph, nodes)
        if d["kind"] == "op" and (d.get("function") or "").endswith("CheckpointFunction")
    ]


def check(graph, nodes=None) -> Iterator[Finding]:
    """Parameters that require grad but no path from the roots reaches."""
    params = graph.graph.get(PARAMS, {})
    missing = [name for name, p in params.items() if p["requires_grad"] and p.get("node") is None]
    if not missing:
        return
    inside = checkpointed(graph)
    if inside is not None:
        dead_region = [n for n in missing if n in inside and inside[n] is None]
        missing = [n for n in missing if n not in inside]
        passed = checkpoint_inputs(graph)
        by_input: dict = {}
        for n in [n for n in dead_region if n in passed]:
            by_input.setdefault(id(passed[n]), (passed[n], []))[1].append(n)
        for ev, names in by_input.values():
            yield _detached(ev, names)
        dead_region = [n for n in dead_region if n not in passed]
        if dead_region:
            yield _dead_region(dead_region)
    cuts = cuts_by_param(graph)
    called = graph.graph.get(CALLED_MODULES)
    by_cut: dict = {}  # one finding per cut: every parameter it drops
    plain: list[str] = []
    for name in missing:
        ev = cuts.get(name)
        if ev is not None:
            by_cut.setdefault((ev["kind"], ev["op"], ev["location"]), (ev, []))[1].append(name)
        else:
            plain.append(name)
    for ev, names in by_cut.values():
        yield _detached(ev, names)
    if not plain:
        return
    if called is None:  # untraced: one finding, the walk cannot tell one cause from several
        hidden = opaque_nodes(graph, nodes) if inside is None else []
        yield _untraced(plain, hidden, graph)
        return
    hidden = opaque_nodes(graph, nodes)
    for module, names in _group(plain):
        never_called = module is not None and module not in called
        if hidden and not never_called:
            # the module ran, maybe inside a reentrant checkpoint body that re-enabled grad
            # (torch.enable_grad() under the region's no_grad): its ops are not the region's, so the
            # trace cannot tell; say what the untraced walk says (tests/trace: test_enable_grad_in_region)
            yield _untraced(names, hidden, graph)
        else:
            yield _unused(module, names, never_called, called)


def describe_cut(ev: dict) -> str:
    """``"cut by .detach() at model.py:42"``: what a trace event did and where (op named when it adds)."""
    where = f"at {ev['location']}" if ev.get("location") else "at an unknown location"
    if ev["kind"] == "checkpoint-input":  # NOTE [cuts that show after a Function returns]
        how = "inside a tuple, list, dict or dataclass argument" if ev.get("nested") else "from outside its arguments"
        return (
            f"passed to checkpoint(..., use_reentrant=True) {how} {where}: the reentrant checkpoint "
            "differentiates only its top-level tensor arguments, so no input of the region required grad and "
            "its output has no graph"
        )
    if ev.get("function"):
        return (
            f"returned without a gradient by the custom autograd.Function {ev['function']} {where}: its forward "
            "marked that output with ctx.mark_non_differentiable(), and the loss uses it"
        )
    if "op_location" in ev:
        # NOTE [inference-mode regions]: the location is the region's
        return (
            f"computed under torch.inference_mode(), in the region entered {where} ({ev['op']} at "
            f"{ev['op_location']}); its results are inference tensors without a graph, and a .clone() "
            "after the region copies the values, not the graph"
        )
    if ev["op"] == "detach_":
        words = "cut by .detach_(), which detaches the tensor itself in place"
    else:
        words = _COPY_OPS.get(ev["op"]) or _CUT_WORDS.get(ev["kind"], ev["kind"])
    op = f" ({ev['op']})" if ev["op"] not in words else ""  # "cut by .detach()", not "... (detach)"
    if ev.get("hook"):  # NOTE [cuts in forward hooks]
        module = f" of module {ev['hook_module']}" if ev.get("hook_module") else ""
        return f"{words}{op} in the forward hook {ev['hook']}{module}, whose return value replaces the output, {where}"
    return f"{words}{op} {where}"


def cut_fix(ev: dict) -> str:
    """What to do about the cut ``ev`` (the advice sentence of its finding)."""
    if "op_location" in ev:
        return (
            "Run that part outside torch.inference_mode() (under torch.no_grad() it gets no gradient either), "
            "or freeze its parameters (requires_grad_(False)) if that is intended."
        )
    if ev["kind"] == "checkpoint-input":
        return (
            "Pass the tensors as top-level arguments (checkpoint(fn, h, x, use_reentrant=True)), or use "
            "checkpoint(..., use_reentrant=False), which follows tensors inside containers."
        )
    if ev.get("function"):
        return (
            "Do not mark an output the loss needs as non-differentiable (return its gradient from backward()), "
            "or compute it outside the Function."
        )
    if ev.get("hook"):
        return (
            "Let the hook return None (keep the detached copy for yourself and leave the output alone), or "
            "freeze the module (requires_grad_(False)) if that is intended."
        )
    return ""


def _subject(names, module=None) -> str:
    if len(names) <= 3:
        return ", ".join(names)
    return f"{len(names)} parameters of {module or 'the model'} ({names[0]}, {names[1]}, ...)"


def _detached(ev, names) -> Finding:
    them = "it" if len(names) == 1 else "them"
    fix = cut_fix(ev) or f"Remove the cut, or freeze {them} (requires_grad_(False)) if that is intended."
    return Finding(
        DETACHED_BRANCH,
        ERROR,
        f"{_subject(names)} {'gets' if len(names) == 1 else 'get'} no gradient: the branch was "
        f"{describe_cut(ev)}. {fix}",
        params=tuple(names),
        location=ev["location"],
    )


def skipped_by(module: str, called) -> str:
    """``"the forward of module enc ran and skipped it"``: the nearest enclosing module that ran (the trace's
    ``called`` names), or the root module's."""
    parent = module.rpartition(".")[0]
    while parent and parent not in called:
        parent = parent.rpartition(".")[0]
    return f"the forward of {f'module {parent}' if parent else 'the root module'} ran and skipped it"


def _unused(module, names, never_called, called=()) -> Finding:
    subject = _subject(names, module)
    if never_called:
        text = (
            f"{subject} will get no gradient (.grad stays None): not used by this forward, module {module} "
            f"was never called in the forward pass ({skipped_by(module, called)}). Call it in forward(), or "
            "freeze it (requires_grad_(False)); "
            "if it is skipped only on some steps, pass find_unused_parameters=True to DDP."
        )
    else:
        where = f"module {module} ran in the forward pass" if module else "they were used in the forward pass"
        text = (
            f"{subject} will get no gradient (.grad stays None): {where}, but nothing computed from "
            "them reaches the root (the result was dropped or overwritten). Use that result in the "
            "loss, or freeze them (requires_grad_(False)) if they are not meant to train."
        )
    return Finding(UNUSED_PARAMETER, ERROR, text, params=tuple(names))


def _untraced(names, hidden, graph) -> Finding:
    modules = sorted({n.rpartition(".")[0] or "the root module" for n in names})
    if len(names) <= 3 or len(modules) == 1:
        subject, of = _subject(names, modules[0] if len(modules) == 1 else None), ""
    else:
        subject = f"{len(names)} parameters ({names[0]}, {names[1]}, ...)"
        of = f" of {', '.join(modules[:4])}{' and more' if len(modules) > 4 else ''}"
    if hidden:
        return Finding(
            UNUSED_PARAMETER,
            WARNING,
            f"{subject}{of}: no path from the root reaches them, but they may be used inside "
            f"{len(hidden)} reentrant checkpoint region(s) (first: {graph.nodes[hidden[0]]['name']}, "
            f"{hidden[0]}), whose parameters only backward() sees. Check whether .grad is None after "
            "backward(), or record the forward with gradscope.trace() to know for sure.",
            params=tuple(names),
        )
    return Finding(
        UNUSED_PARAMETER,
        ERROR,
        f"{subject}{of} will get no gradient (.grad stays None): no path from the root reaches them. "
        "Record the forward with gradscope.trace() to learn where the path was lost (a .detach(), a "
        "no_grad block, a module never called), or freeze them (requires_grad_(False)) if they are not "
        "meant to train.",
        params=tuple(names),
    )


def _dead_region(names) -> Finding:
    return Finding(
        UNUSED_PARAMETER,
        ERROR,
        f"{_subject(names)} {'is' if len(names) == 1 else 'are'} used only inside a reentrant checkpoint "
        "region whose inputs do not require grad: torch warns 'None of the inputs have requires_grad=True. "
        "Gradients will be None', and the region's output is cut from the graph. Make an input of the "
        "region require grad, or use checkpoint(..., use_reentrant=False).",
        params=tuple(names),
    )


def _group(names: list[str]):
    groups: dict = {}
    for n in names:
        groups.setdefault(n.rpartition(".")[0] or None, []).append(n)
    return list(groups.items())


def checkpointed(graph) -> dict | None:
    """Traced: parameter -> the checkpoint node whose body used it (None: a region not in the graph)."""
    used = graph.graph.get(CHECKPOINT_PARAMS)
    if used is None:
        return None
    regions = {
        d.get("seq"): n
        for n, d in graph.nodes(data=True)
        if d["kind"] == "op" and (d.get("function") or "").endswith("CheckpointFunction")
    }
    return {name: next((regions[s] for s in seqs if s in regions), None) for name, seqs in used.items()}


def checkpoint_inputs(graph) -> dict:
    """parameter -> the ``checkpoint-input`` event whose tensor, behind it, a reentrant checkpoint did not see."""
    out: dict = {}
    for ev in graph.graph.get(EVENTS, ()):
        if ev["kind"] == "checkpoint-input":
            for p in ev.get("params", ()):
                out.setdefault(p, ev)
    return out


def _op_seqs(graph) -> list[int]:
    """The sorted sequence numbers of the graph's op nodes, read from the compact records when the graph
    is the compact view (no node dict made), else from the node dicts."""
    records = getattr(graph, "compact", None)
    if records is not None:
        leaves, seqs = records.leaves, records.seqs
        return sorted(seqs[i] for i in range(len(records)) if i not in leaves)
    return sorted(d["seq"] for _, d in graph.nodes(data=True) if d.get("kind") == "op" and d.get("seq") is not None)


def cuts_by_param(graph) -> dict:
    """parameter -> the recorded event that severed its path.

    A cut whose result joined a node of this graph comes first (NOTE [where a cut joins] in
    gradscope/tracing/modes.py), then the strongest kind (see ``_RANK``). A cut that joined nothing does
    not explain the parameters of a module this forward never called: they were not used (an adapter
    merged under no_grad, then skipped). Events recorded after the roots were made (an optimizer creating
    its state under no_grad at ``opt.step()``, logging after the loss) cannot have cut anything in this
    graph and are ignored.
    """
    seqs = [graph.nodes[r].get("seq") for r in graph.graph.get(ROOTS, ())]
    last = max((s for s in seqs if s is not None), default=None)
    called = graph.graph.get(CALLED_MODULES)
    in_graph = _op_seqs(graph)
    out: dict = {}
    for ev in graph.graph.get(EVENTS, ()):
        if ev["kind"] in ("inplace", "checkpoint-input") or (
            last is not None and ev.get("seq") is not None and ev["seq"] > last
        ):
            continue
        joined = _joined(ev, in_graph)
        key = (0 if joined else 1, _RANK.get(ev["kind"], 9))
        for p in ev.get("params", ()):
            if not joined and called is not None:
                module = p.rpartition(".")[0]
                if module and module not in called:
                    continue  # not used by this forward, not cut
            if p not in out or key < out[p][0]:
                out[p] = (key, ev)
    return {p: ev for p, (_, ev) in out.items()}


def _joined(ev: dict, in_graph: list[int]) -> bool:
    """Whether the cut's result joined a node of the graph (True when the event does not say)."""
    joins = ev.get("joins")
    if joins is None:
        return True
    for first, end in joins:
        i = bisect_left(in_graph, first)
        if i < len(in_graph) and in_graph[i] < end:
            return True
    return False
