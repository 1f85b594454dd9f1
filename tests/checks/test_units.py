"""Each check on small hand-built graphs, written with the schema's names (gradscope.graph.schema).

The behaviour tests run real forwards; these pin what each check concludes from exactly the metadata the
walk records, one situation per test, so a change in a check's rule shows up here before a model test.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from gradscope import findings
from gradscope.checks import freed, inplace, roots, run_checks, unused
from gradscope.findings import (
    DETACHED_BRANCH,
    ERROR,
    FREED_GRAPH,
    INPLACE_HAZARD,
    NO_GRAD_ROOT,
    NON_SCALAR_ROOT,
    UNUSED_PARAMETER,
    WARNING,
)
from gradscope.graph import (
    CALLED_MODULES,
    CHECKPOINT_PARAMS,
    EVENTS,
    FREED,
    LIVE,
    NO_GRAD_ROOTS,
    OP,
    PARAM,
    PARAMS,
    ROOT_SHAPES,
    ROOTS,
    STALE,
)


def _slot(status=LIVE, storage=0, shape=(4,), **extra) -> dict:
    return {"slot": "self", "shape": list(shape), "dtype": "float32", "device": "cpu", "nbytes": 16,
            "status": status, "storage": storage, **extra}  # fmt: skip


def _graph(ops, params=None, **attrs) -> nx.DiGraph:
    """``ops``: ``(id, name, seq, saved)``, consumed in a chain (each feeds the one before it; the first is
    the root); ``params``: name -> node id or None, with requires_grad True."""
    g = nx.DiGraph()
    for nid, name, seq, saved in ops:
        g.add_node(nid, kind=OP, name=name, seq=seq, saved=list(saved), saved_bytes=0, module=None, root=False)
    for (child, *_), (parent, *_) in zip(ops[1:], ops):
        g.add_edge(child, parent, index=0, output=0, count=1)
    info = {}
    for name, node in (params or {}).items():
        if node is not None:
            g.add_node(node, kind=PARAM, name=name, saved=[], module=name.rpartition(".")[0] or None)
            g.add_edge(node, ops[-1][0], index=1, output=0, count=1)
        info[name] = {"requires_grad": True, "shape": [4], "dtype": "float32", "node": node, "storage": None}
    g.graph.update({ROOTS: [ops[0][0]], ROOT_SHAPES: [[]], PARAMS: info, **attrs})
    return g


# -- roots ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, flagged", [([], False), ([1, 1], False), ([2, 3], True), (None, True), ([0], True)])
def test_roots_a_root_is_fine_only_with_one_element(shape, flagged):
    g = _graph([("n0", "SumBackward0", 1, ())], **{ROOT_SHAPES: [shape]})
    found = list(roots.check(g))
    assert [(f.kind, f.severity, f.node) for f in found] == ([(NON_SCALAR_ROOT, WARNING, "n0")] if flagged else [])
    if flagged:
        assert ("a nested tensor" if shape is None else f"shape {tuple(shape)}") in found[0].message


def test_roots_a_root_without_grad_fn_is_an_error_naming_its_index():
    g = _graph([("n0", "SumBackward0", 1, ())], **{NO_GRAD_ROOTS: [1]})
    (f,) = roots.check(g)
    assert (f.kind, f.severity, f.node) == (NO_GRAD_ROOT, ERROR, None) and f.message.startswith("Root 1 ")


# -- freed ------------------------------------------------------------------------------------------
def test_freed_one_finding_at_the_first_freed_node():
    g = _graph([("n0", "SumBackward0", 3, ()), ("n1", "ExpBackward0", 2, [_slot(FREED, None)]),
                ("n2", "SinBackward0", 1, [_slot(FREED, None)])])  # fmt: skip
    (f,) = freed.check(g)
    assert (f.kind, f.severity, f.node) == (FREED_GRAPH, ERROR, "n1")
    assert "2 node(s)" in f.message and "Exp" in f.message and "Backward0" not in f.message  # the user's words


def test_freed_only_the_given_nodes_are_read():
    g = _graph([("n0", "SumBackward0", 2, ()), ("n1", "ExpBackward0", 1, [_slot(FREED, None)])])
    assert list(freed.check(g, nodes=["n0"])) == [] and len(list(freed.check(g, nodes=["n1"]))) == 1
    assert list(freed.check(_graph([("n0", "ExpBackward0", 1, [_slot()])]))) == []


# -- inplace ----------------------------------------------------------------------------------------
def test_inplace_a_stale_slot_is_one_error_with_both_versions():
    stale = _slot(STALE, 7, version=1, saved_version=0)
    g = _graph([("n0", "SumBackward0", 2, ()), ("n1", "SigmoidBackward0", 1, [{**stale, "slot": "result"}])])
    (f,) = inplace.check(g)
    assert (f.kind, f.severity, f.node) == (INPLACE_HAZARD, ERROR, "n1")
    assert "its own output" in f.message and "version 0" in f.message and "now at version 1" in f.message
    assert "result" not in f.message.replace("its own output", "")  # no autograd slot names


def test_inplace_one_tensor_saved_twice_is_one_finding_at_its_first_saver():
    stale = _slot(STALE, 7, version=1, saved_version=0)
    g = _graph([("n0", "SumBackward0", 3, ()), ("n1", "MulBackward0", 2, [stale]), ("n2", "MmBackward0", 1, [stale])])
    (f,) = inplace.check(g)
    assert f.node == "n2" and "also saved by Mul" in f.message


def test_inplace_a_traced_write_gives_the_op_and_its_line():
    stale = _slot(STALE, 7, version=1, saved_version=0)
    write = {"kind": "inplace", "op": "mul_", "location": "model.py:12 in forward", "params": [], "module": None,
             "seq": 2, "shape": [4], "version": 1}  # fmt: skip
    g = _graph([("n0", "SumBackward0", 3, ()), ("n1", "ExpBackward0", 1, [stale])], **{EVENTS: [write]})
    (f,) = inplace.check(g)
    assert f.location == "model.py:12 in forward" and "by mul_ at model.py:12" in f.message


def test_inplace_a_write_before_the_node_was_made_is_not_its_cause():
    stale = _slot(STALE, 7, version=1, saved_version=0)
    early = {"kind": "inplace", "op": "add_", "location": "model.py:3", "params": [], "module": None, "seq": 1,
             "shape": [4], "version": 1}  # fmt: skip
    g = _graph([("n0", "SumBackward0", 3, ()), ("n1", "ExpBackward0", 2, [stale])], **{EVENTS: [early]})
    (f,) = inplace.check(g)
    assert f.location is None and "model.py:3" not in f.message


# -- unused -----------------------------------------------------------------------------------------
def test_unused_a_parameter_the_root_does_not_reach():
    g = _graph([("n0", "SumBackward0", 1, ())], params={"a.weight": "p0", "b.weight": None})
    (f,) = unused.check(g)
    assert (f.kind, f.severity, f.params) == (UNUSED_PARAMETER, ERROR, ("b.weight",))
    g.graph[PARAMS]["b.weight"]["requires_grad"] = False  # frozen: nothing to say
    assert list(unused.check(g)) == []


def test_unused_traced_a_module_never_called_is_named_so():
    g = _graph([("n0", "SumBackward0", 1, ())], params={"a.weight": "p0", "b.weight": None},
               **{CALLED_MODULES: ["a"], EVENTS: []})  # fmt: skip
    (f,) = unused.check(g)
    assert "module b was never called" in f.message


def test_unused_traced_a_cut_before_the_root_is_a_detached_branch_with_its_line():
    cut = {"kind": "detach", "op": "detach", "location": "model.py:7 in forward", "params": ["b.weight"],
           "module": "b", "seq": 0, "shape": [4]}  # fmt: skip
    late = {**cut, "location": "train.py:40", "seq": 9}  # recorded after the root was made: it cut nothing here
    events = {CALLED_MODULES: ["b"], EVENTS: [late, cut]}  # the first of two equal cuts would win
    g = _graph([("n0", "SumBackward0", 1, ())], params={"b.weight": None}, **events)
    (f,) = unused.check(g)
    assert (f.kind, f.location, f.params) == (DETACHED_BRANCH, "model.py:7 in forward", ("b.weight",))
    assert "cut by .detach()" in f.message


def test_unused_untraced_a_reentrant_checkpoint_lowers_it_to_a_warning():
    g = _graph([("n0", "SumBackward0", 2, ()), ("n1", "CheckpointFunctionBackward", 1, ())], params={"b.weight": None})
    g.nodes["n1"]["function"] = "torch.utils.checkpoint.CheckpointFunction"
    (f,) = unused.check(g)
    assert (f.kind, f.severity) == (UNUSED_PARAMETER, WARNING) and "checkpoint" in f.message
    g.graph[CHECKPOINT_PARAMS] = {"b.weight": [1]}  # traced: b was used inside that region, so it is fine
    assert list(unused.check(g)) == []


def test_unused_traced_a_module_that_ran_but_whose_result_was_dropped():
    g = _graph([("n0", "SumBackward0", 1, ())], params={"a.weight": "p0", "b.weight": None},
               **{CALLED_MODULES: ["a", "b"], EVENTS: []})  # fmt: skip
    (f,) = unused.check(g)
    assert (f.kind, f.severity, f.params) == (UNUSED_PARAMETER, ERROR, ("b.weight",))
    assert "module b ran in the forward pass" in f.message and "never called" not in f.message
    a, b, x = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1), torch.randn(3, 2)
    b(x)  # torch: the dropped result sends b nothing
    a(x).sum().backward()
    assert b.weight.grad is None and a.weight.grad is not None


def test_unused_traced_a_checkpoint_region_whose_inputs_need_no_grad_is_an_error():
    # the region's node is not in the graph (its output was cut), so checkpointed() maps the parameter to None
    g = _graph([("n0", "SumBackward0", 13, ())], params={"lin.weight": None},
               **{CALLED_MODULES: ["lin"], EVENTS: [], CHECKPOINT_PARAMS: {"lin.weight": [12]}})  # fmt: skip
    (f,) = unused.check(g)
    assert (f.kind, f.severity, f.params) == (UNUSED_PARAMETER, ERROR, ("lin.weight",))
    assert "only inside a reentrant checkpoint region" in f.message
    lin = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True. Gradients will be None"):
        out = checkpoint(lin, torch.randn(2, 4), use_reentrant=True)  # torch warns what the finding quotes
    assert not out.requires_grad  # and cuts the output: nothing reaches lin.weight


def test_unused_traced_beside_a_reentrant_checkpoint_a_module_that_ran_is_a_warning():
    g = _graph([("n0", "SumBackward0", 2, ()), ("n1", "CheckpointFunctionBackward", 1, ())], params={"b.weight": None},
               **{CALLED_MODULES: ["b"], EVENTS: [], CHECKPOINT_PARAMS: {}})  # fmt: skip
    g.nodes["n1"]["function"] = "torch.utils.checkpoint.CheckpointFunction"
    (f,) = unused.check(g)  # b may have run inside the region under enable_grad(): the trace cannot tell
    assert (f.kind, f.severity) == (UNUSED_PARAMETER, WARNING) and "reentrant checkpoint" in f.message
    g.graph[CALLED_MODULES] = []  # never called: the region cannot have used it
    (f,) = unused.check(g)
    assert (f.kind, f.severity) == (UNUSED_PARAMETER, ERROR) and "module b was never called" in f.message


def test_detached_one_cut_is_one_finding_for_every_parameter_it_drops_and_the_strongest_cut_wins():
    cut = {"kind": "detach", "op": "detach", "location": "model.py:7", "params": ["b.weight", "b.bias"],
           "module": "b", "seq": 0, "shape": [4]}  # fmt: skip
    item = {**cut, "kind": "to-python", "op": "item", "location": "model.py:9", "params": ["b.weight"]}
    g = _graph([("n0", "SumBackward0", 1, ())], params={"b.weight": None, "b.bias": None},
               **{CALLED_MODULES: ["b"], EVENTS: [item, cut]})  # fmt: skip
    (f,) = unused.check(g)  # .item() next to a real .detach() is a logged value: the detach is the cause
    assert (f.kind, f.severity, f.params, f.location) == (DETACHED_BRANCH, ERROR, ("b.weight", "b.bias"), "model.py:7")
    assert f.message.startswith("b.weight, b.bias get no gradient: the branch was cut by .detach() at model.py:7")
    b = torch.nn.Linear(4, 1)
    (b(torch.randn(2, 4)).detach() * torch.ones(2, 1, requires_grad=True)).sum().backward()
    assert b.weight.grad is None and b.bias.grad is None  # torch: a detached branch sends nothing back


# -- inplace: the two traced stories --------------------------------------------------------------
def test_inplace_a_write_inside_a_reentrant_checkpoint_is_an_error_at_the_region():
    write = {"kind": "inplace", "op": "mul_", "location": "model.py:19", "params": [], "module": "blk", "seq": 11,
             "shape": [2, 4], "version": 1, "producer": "sigmoid", "region": 10}  # fmt: skip
    g = _graph([("n0", "SumBackward0", 11, ()), ("n1", "CheckpointFunctionBackward", 10, ())], **{EVENTS: [write]})
    g.nodes["n1"]["function"] = "torch.utils.checkpoint.CheckpointFunction"
    (f,) = inplace.check(g)
    assert (f.kind, f.severity, f.node, f.location) == (INPLACE_HAZARD, ERROR, "n1", "model.py:19")
    assert "output of sigmoid() inside a reentrant checkpoint region (in blk)" in f.message
    g.graph[EVENTS] = [{**write, "region": 3}]  # a region this graph does not hold (its inputs need no grad)
    assert list(inplace.check(g)) == []
    lin = torch.nn.Linear(4, 4)

    def body(x):
        h = torch.sigmoid(lin(x))
        h.mul_(2)
        return h

    out = checkpoint(body, torch.randn(2, 4, requires_grad=True), use_reentrant=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # torch: the recompute raises
        out.sum().backward()


def test_inplace_a_slice_written_in_place_then_written_again_is_one_error_at_its_copyslices():
    first = {"kind": "inplace", "op": "sigmoid_", "location": "model.py:7", "params": [], "module": None, "seq": 8,
             "shape": [3, 2], "version": 1, "storage": 5, "view": True}  # fmt: skip
    later = {**first, "op": "mul_", "location": "model.py:8", "seq": 9, "shape": [3, 4], "version": 2, "view": False}
    stale = _slot(STALE, 5, shape=(3, 2), version=2, saved_version=1)
    ops = [("n0", "SumBackward0", 9, ()), ("n1", "MulBackward0", 8, ()), ("n2", "CopySlices", 6, [stale])]
    (f,) = inplace.check(_graph(ops, **{EVENTS: [first, later]}))  # the stale slot is this story, told once
    assert (f.kind, f.severity, f.node, f.location) == (INPLACE_HAZARD, ERROR, "n2", "model.py:8")
    assert "sigmoid_ at model.py:7 wrote a slice in place" in f.message and "then mul_ at model.py:8" in f.message
    (f,) = inplace.check(_graph(ops, **{EVENTS: [first]}))  # no later write recorded: the plain stale-slot story
    assert f.node == "n2" and "wrote a slice" not in f.message
    b = torch.randn(3, 4, requires_grad=True) * 1
    b[:, :2].sigmoid_()
    b.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # torch: backward() raises
        b.sum().backward()


def _kind_names(tree: ast.AST, kinds: set[str]) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in kinds}


def test_every_kind_the_checks_make_has_a_unit_test_here():
    kinds = {k for k in findings.__all__ if getattr(findings, k) in findings.KINDS}
    made = set().union(*(_kind_names(ast.parse(p.read_text(encoding="utf-8")), kinds)
                         for p in Path(unused.__file__).parent.glob("*.py")))  # fmt: skip
    assert {"UNUSED_PARAMETER", "DETACHED_BRANCH", "INPLACE_HAZARD", "FREED_GRAPH"} <= made  # the scan sees them
    me = test_every_kind_the_checks_make_has_a_unit_test_here.__name__
    tests = [n for n in ast.parse(Path(__file__).read_text(encoding="utf-8")).body
             if isinstance(n, ast.FunctionDef) and n.name.startswith("test_") and n.name != me]  # fmt: skip
    tested = set().union(*(_kind_names(t, kinds) for t in tests))
    assert made <= tested, f"finding kinds the checks make with no unit test here: {sorted(made - tested)}"


def test_run_checks_orders_errors_first():
    g = _graph([("n0", "SumBackward0", 2, ()), ("n1", "ExpBackward0", 1, [_slot(FREED, None)])],
               params={"b.weight": None}, **{ROOT_SHAPES: [[2]]})  # fmt: skip
    assert [(f.severity, f.kind) for f in run_checks(g)] == [
        (ERROR, UNUSED_PARAMETER), (ERROR, FREED_GRAPH), (WARNING, NON_SCALAR_ROOT)]  # fmt: skip
