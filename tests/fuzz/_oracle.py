"""Torch as the oracle: run a program with and without gradscope and compare every prediction.

Three identical executions (same seed) of each program:
  A  gradscope.inspect, then backward: predictions vs what backward() did, versions untouched;
  B  backward without gradscope: gradients must be bit-identical to A's;
  C  under saved_tensors_hooks (identity pack into a weak-referenceable box): after every tensor but the
     root is dropped, the live boxes are exactly the tensors the graph still holds; their unique storages
     must add up to ``report.saved_bytes``. Pack hooks disable autograd's version check
     (docs/internals.md#pack-hooks-and-the-version-check),
     so C never runs backward; wrapped Python scalars never reach the hooks
     (docs/internals.md#wrapped-python-scalars) and
     gradscope leaves them out too; checkpointed slots go through checkpoint's own inner hooks.
"""

from __future__ import annotations

import gc
import weakref

import networkx as nx
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import gradscope
from gradscope.errors import NoGradRootError

from ._program import Program, run_program

__all__ = ["check_program", "count_nodes", "hooked_saved_bytes", "packed_bytes", "backward_truth"]


def count_nodes(roots) -> int:
    """Independent count of graph nodes reachable from ``roots`` (iterative, with a seen set)."""
    return len(reachable(roots))


def reachable(roots) -> set:
    """The autograd nodes reachable from ``roots``."""
    seen = set()
    stack = []
    for r in roots:
        if r.grad_fn is not None:
            stack.append(r.grad_fn)
        elif r.requires_grad:
            try:
                stack.append(torch.autograd.graph.get_gradient_edge(r).node)
            except AssertionError:  # a view of a leaf taken under no_grad: nothing to differentiate
                pass
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(c for c, _ in n.next_functions if c is not None and c not in seen)
    return seen


class _Box:
    # Holds the storage, not the tensor: a saved output holds its own grad_fn, so a box holding the
    # tensor would make a reference cycle through the C++ node that gc cannot see.
    __slots__ = ("storage", "__weakref__")


def hooked_saved_bytes(prog: Program, seed: int = 0) -> int:
    """Bytes of unique storages still packed by the graph of ``prog``'s root (run C)."""
    return packed_bytes(lambda: run_program(prog, seed).root)


def packed_bytes(make_root) -> int:
    """Run ``make_root()`` under identity-like pack hooks; bytes of unique storages its graph holds."""
    boxes = []

    def pack(t):
        b = _Box()
        b.storage = t.untyped_storage()
        boxes.append(weakref.ref(b))
        return b

    def unpack(b):
        raise AssertionError("run C never unpacks")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        root = make_root()
    gc.collect()
    sizes = {}
    for ref in boxes:
        b = ref()
        if b is not None:
            st = b.storage
            sizes[StorageWeakRef(st).cdata] = st.nbytes()
    del root
    return sum(sizes.values())


def _kind(exc: RuntimeError) -> str:
    msg = str(exc)
    if "modified by an inplace operation" in msg or \
            "is a view and its base or another view of its base has been modified inplace" in msg:
        return "inplace"
    if "implicitly created only for scalar outputs" in msg:
        return "nonscalar"
    if "does not require grad and does not have a grad_fn" in msg:
        return "nograd"
    if "none of output has requires_grad=True, this checkpoint() is not necessary" in msg:
        # Reentrant checkpoint around an op whose output does not depend differentiably on its inputs:
        # torch finds out only while recomputing; no gradscope finding claims to predict it.
        return "ckpt-unnecessary"
    raise exc  # anything else is unexpected: let the test show it


def _differentiable(r) -> bool:
    if r.grad_fn is not None:
        return True
    try:
        return r.requires_grad and torch.autograd.graph.get_gradient_edge(r).node is not None
    except AssertionError:  # a view of a leaf taken under no_grad claims requires_grad
        return False


def backward_truth(root) -> dict:
    """Run backward the way a user would, then the corrected backward; return what torch did."""
    roots = list(root) if isinstance(root, list) else [root]
    errors = []
    try:
        torch.autograd.backward(roots)
        return {"errors": errors, "ok": True}
    except RuntimeError as exc:
        errors.append(_kind(exc))
    if errors[-1] not in ("nonscalar", "nograd"):  # the engine ran: graph freed
        return {"errors": errors, "ok": False}
    grad_roots = [r for r in roots if _differentiable(r)]
    if not grad_roots:  # ask torch for its verdict on the corrected call, which must be "nograd"
        try:
            torch.autograd.backward(roots, [torch.ones_like(r) for r in roots])
        except RuntimeError as exc:
            errors.append(_kind(exc))
        return {"errors": errors, "ok": False}
    try:
        torch.autograd.backward(grad_roots, [torch.ones_like(r) for r in grad_roots])
        return {"errors": errors, "ok": True}
    except RuntimeError as exc:
        errors.append(_kind(exc))
    return {"errors": errors, "ok": False}


def _grads(run) -> dict:
    out = {n: p.grad for n, p in run.params.items()}
    out["<input m>"] = run.inputs[1].grad
    return out


def _only_through_opaque(graph) -> set:
    """Params whose every path to a root crosses a custom Function / reentrant checkpoint node.

    Such a node's backward may return None for an input it did not use (reentrant checkpoint around an
    op that ignores one of its inputs does), which no walk can predict: gradscope makes no claim there.
    """
    opaque = [n for n, d in graph.nodes(data=True) if d.get("function")]
    if not opaque:
        return set()
    cut = graph.subgraph([n for n in graph if n not in opaque])
    out = set()
    for n, d in graph.nodes(data=True):
        if d["kind"] == "param" and n in cut:
            if not any(nx.has_path(cut, n, r) for r in graph.graph["roots"] if r in cut):
                out.add(d["name"])
    return out


def _same_bits(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def check_program(prog: Program, seed: int = 0, traced: bool = False, watched: bool = False) -> None:
    """Assert every gradscope prediction about ``prog`` against torch (see the module docstring).

    With ``traced``, run A's forward is recorded by ``gradscope.trace()`` and passed to ``inspect`` (cut
    findings become ``detached-branch``); gradients must still be bit-identical to run B's. With
    ``watched``, run A's backward runs under ``gradscope.watch`` of the parameters: its ``none-grad`` /
    ``nonfinite-grad`` findings must name exactly the parameters torch left without a gradient or with
    a NaN/Inf one.
    """
    # B: the same program without gradscope.
    base = run_program(prog, seed)
    base_truth = backward_truth(base.root)
    base_grads = _grads(base)
    del base

    # A: inspect, then backward.
    if traced:
        modes = torch._C._len_torch_function_stack()
        with gradscope.trace() as tr:
            run = run_program(prog, seed)
        assert torch._C._len_torch_function_stack() == modes, "trace() left a mode installed"
    else:
        tr = None
        run = run_program(prog, seed)
    roots = list(run.root) if isinstance(run.root, list) else [run.root]
    tensors = run.pool + list(run.params.values()) + roots
    versions = [t._version for t in tensors]
    try:
        report = gradscope.inspect(run.root, params={n: p for n, p in run.params.items()}, trace=tr)
    except NoGradRootError:
        report = None
    assert [t._version for t in tensors] == versions, "inspect() changed a tensor's _version"
    del tensors
    if watched:
        holder = torch.nn.ParameterDict(run.params)   # the same Parameter objects, for watch(model)
        problems = []
        guard = gradscope.watch(holder, on_error=problems.append)
    reach = reachable(roots)
    expected_nodes = len(reach)
    # NOTE [checkpoint side channel]: checkpoint(use_reentrant=False) keeps its inputs alive in its
    # frame; an input the region does not use differentiably is not in the backward graph, yet it keeps
    # its own history (and that history's saved tensors) alive. No walk of next_functions sees that
    # memory, so saved_bytes is a lower bound then (documented in the README).
    side = any(n not in reach for n in run.ckpt_nodes)
    del reach
    try:
        truth = backward_truth(run.root)
    finally:
        if watched:
            guard.remove()
    assert truth == base_truth, f"backward behaved differently after inspect: {truth} vs {base_truth}"
    grads = _grads(run)
    for name, g in grads.items():
        assert _same_bits(g, base_grads[name]), f"gradient of {name} differs after inspect()"

    if watched and truth["ok"]:
        last = problems[-1] if problems else ()
        said_none = {p for f in last if f.kind == "none-grad" for p in f.params}
        said_bad = {p for f in last if f.kind == "nonfinite-grad" for p in f.params}
        trainable = {n: p for n, p in run.params.items() if p.requires_grad}
        none = {n for n, p in trainable.items() if p.grad is None}
        if none != set(trainable) or said_none:  # a backward that reaches no parameter is not checked
            assert said_none == none, f"watch none-grad said {said_none}, torch left {none} None"
        assert said_bad == {n for n, p in trainable.items()
                            if p.grad is not None and not torch.isfinite(p.grad).all()}, "watch nonfinite"
    if "ckpt-unnecessary" in truth["errors"]:
        return  # backward stopped for a reason outside gradscope's predictions
    if report is None:
        assert truth["errors"][-1] == "nograd" and not truth["ok"], "NoGradRootError, torch disagrees"
        return
    kinds = {f.kind for f in report.findings}
    # NOTE [CopySlices hides its op]: an in-place op on a view becomes a CopySlices node that wraps the
    # op's own backward node (and the tensors it saved) without exposing it to Python. gradscope cannot
    # see those slots: its saved bytes are a lower bound and a hazard on them is missed (documented in
    # the README). Everywhere else the predictions must be exact.
    hidden = any(d["name"] == "CopySlices" for _, d in report.graph.nodes(data=True))
    # An in-place write inside a reentrant checkpoint body breaks only the graph backward() rebuilds:
    # untraced it cannot be seen, traced it is found when the tensor's maker saves its output (NOTE
    # [in-place inside reentrant checkpoint], exact cases in tests/checks/test_exact16.py). Here: never a false one.
    rebuilt = any((d.get("function") or "").endswith("CheckpointFunction")
                  for _, d in report.graph.nodes(data=True))
    undercount = hidden or side
    assert report.graph.number_of_nodes() == expected_nodes, "node count differs from the walker"
    if hidden or rebuilt:
        assert "inplace-hazard" not in kinds or "inplace" in truth["errors"], "false inplace-hazard"
    else:
        assert ("inplace-hazard" in kinds) == ("inplace" in truth["errors"]), \
            f"inplace-hazard predicted={'inplace-hazard' in kinds}, torch errors={truth['errors']}"
    assert ("no-grad-root" in kinds) == ("nograd" in truth["errors"]), (kinds, truth)
    if "no-grad-root" not in kinds:
        assert ("non-scalar-root" in kinds) == ("nonscalar" in truth["errors"]), (kinds, truth)
    if truth["ok"]:
        hard = {p for f in report.findings if f.severity == "error"
                and f.kind in ("unused-parameter", "detached-branch") for p in f.params}
        soft = {p for f in report.findings if f.severity != "error"
                and f.kind in ("unused-parameter", "detached-branch") for p in f.params}
        soft |= _only_through_opaque(report.graph)
        for name, g in grads.items():
            if name.startswith("<"):
                continue
            if name in hard:
                assert g is None, f"{name} flagged unused (error) but torch gave it a gradient"
            elif name not in soft:
                assert g is not None or not run.params[name].requires_grad, \
                    f"{name} not flagged but torch left its .grad None"
    del run, roots, grads
    packed = hooked_saved_bytes(prog, seed)
    if undercount:
        assert report.saved_bytes <= packed, f"saved_bytes {report.saved_bytes} > packed {packed}"
    else:
        assert report.saved_bytes == packed, \
            f"saved_bytes {report.saved_bytes} != storages packed by saved_tensors_hooks ({packed})"
