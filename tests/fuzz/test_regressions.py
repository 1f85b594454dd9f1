"""Minimal programs the differential fuzzer shrank to, kept so the disagreements stay fixed.

Each runs the full oracle (``check_program``) and asserts the specific torch behaviour it was about.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import gradscope

from ._oracle import backward_truth, check_program, hooked_saved_bytes
from ._program import Program, run_program

# pool at start: [x (input, no grad), a (param), m (leaf input that requires grad)]; new results append.

def _inspected(program, traced=False):
    """Run ``program`` (under ``gradscope.trace()`` when ``traced``): the run and its report."""
    with gradscope.trace() if traced else contextlib.nullcontext() as tr:
        run = run_program(program)
    return run, gradscope.inspect(run.root, params=run.params, trace=tr)


def _one_hazard(program, says):
    """Assert that ``program``'s report has one inplace-hazard and that it says ``says``; return the run."""
    run, report = _inspected(program)
    hazards = [f for f in report.findings if f.kind == "inplace-hazard"]
    assert len(hazards) == 1 and says in hazards[0].message
    return run


CKPT_INPUT_MODIFIED = Program((("mul", 1, 2, "plain"), ("exp", 3, 0, "ckpt"), ("mul_", 3, 0, "plain")),
                              (4,), "sum")
CKPT_INPUT_BYTES = Program((("exp", 1, 0, "ckpt"),), (3,), "sum")
REENTRANT_IGNORES_INPUT = Program((("exp", 0, 0, "plain"), ("exp", 2, 1, "ckpt_reentrant")), (4,), "sum")
REENTRANT_UNNECESSARY = Program((("exp", 0, 1, "ckpt_reentrant"), ("exp", 3, 0, "plain")), (4,), "sum")
COPYSLICES_HIDES_SAVED = Program((("bmm", 0, 0, "plain"), ("index_add_", 3, 1, "plain")), (3,), "sum")


def test_checkpoint_input_modified_in_place_is_a_hazard():
    # Found by the fuzzer: checkpoint(use_reentrant=False) keeps its inputs as version-checked
    # SavedTensors in its frame (reachable only through the unpack hook), and backward's recomputation
    # raises when one was modified in place. Fixed in gradscope/walk/checkpoint.py.
    run = _one_hazard(CKPT_INPUT_MODIFIED, "an input of its checkpoint region")
    assert backward_truth(run.root)["errors"] == ["inplace"]
    check_program(CKPT_INPUT_MODIFIED)


def test_checkpoint_inputs_count_as_saved_bytes():
    # Found by the fuzzer: saved_bytes was 0 while saved_tensors_hooks saw the checkpoint's input.
    run, report = _inspected(CKPT_INPUT_BYTES)
    # checkpoint(exp_op, a, x): both inputs are kept, 2 x (2, 4) float32
    assert report.saved_bytes == hooked_saved_bytes(CKPT_INPUT_BYTES) == 2 * 2 * 4 * 4
    check_program(CKPT_INPUT_BYTES)


def test_reentrant_checkpoint_may_return_none_for_an_input():
    # The checkpointed exp() ignores its second input (the parameter a): torch gives a.grad None although
    # a is reachable, through CheckpointFunctionBackward only. No walk can know what an opaque backward
    # returns; the oracle accepts either outcome for parameters reached only through opaque nodes.
    run, report = _inspected(REENTRANT_IGNORES_INPUT)
    assert report.graph.graph["params"]["a"]["node"] is not None
    run.root.backward()
    assert run.params["a"].grad is None
    check_program(REENTRANT_IGNORES_INPUT)


def test_reentrant_checkpoint_whose_output_needs_no_grad():
    # torch raises 'this checkpoint() is not necessary' only while recomputing in backward.
    run = run_program(REENTRANT_UNNECESSARY)
    gradscope.inspect(run.root, params=run.params)
    assert backward_truth(run.root)["errors"] == ["ckpt-unnecessary"]
    check_program(REENTRANT_UNNECESSARY)


def test_copyslices_saved_tensors_are_a_lower_bound():
    run, report = _inspected(COPYSLICES_HIDES_SAVED)
    assert any(d["name"] == "CopySlices" for _, d in report.graph.nodes(data=True))
    assert report.saved_bytes < hooked_saved_bytes(COPYSLICES_HIDES_SAVED)
    check_program(COPYSLICES_HIDES_SAVED)


def test_hazard_inside_copyslices_is_predicted():
    # torch does not expose the op a CopySlices node wraps; the walk reads it by calling the node on a meta
    # gradient (NOTE [CopySlices formula]), and torch's version error names the stale tensor
    w = torch.randn(4, requires_grad=True)
    h = w * 1
    t = torch.randn(2)
    h[:2].mul_(t)      # CopySlices wraps MulBackward0, which saved t
    t.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h.sum().backward(retain_graph=True)
    report = gradscope.inspect(h.sum(), params={"w": w})
    assert any(f.kind == "inplace-hazard" for f in report.findings)


CKPT_UNUSED_INPUT_HISTORY = Program((("sin", 1, 0, "plain"), ("exp", 2, 3, "ckpt")), (4,), "sum")


def test_checkpoint_input_unused_by_the_region_is_a_side_channel():
    # checkpoint(exp_op, m, sin(a)): exp ignores sin(a), so sin's node is not in the backward graph, but
    # the frame keeps sin(a) alive and with it SinBackward0's saved a. saved_bytes counts what the
    # graph holds (both checkpoint inputs) and is a lower bound of what stays alive.
    run, report = _inspected(CKPT_UNUSED_INPUT_HISTORY)
    assert "SinBackward0" not in {d["name"] for _, d in report.graph.nodes(data=True)}
    assert report.saved_bytes == 64 < hooked_saved_bytes(CKPT_UNUSED_INPUT_HISTORY) == 96
    check_program(CKPT_UNUSED_INPUT_HISTORY)


CUT_AND_REENTRANT = Program((("addmm", 0, 0, "no_grad"), ("linear", 0, 1, "ckpt_reentrant")), (4,), "sum")


def test_cut_parameter_also_used_in_reentrant_checkpoint_is_not_flagged_when_traced():
    # Found by the slow profile (traced): b is cut by a no_grad region (addmm) and also used by linear
    # inside a reentrant checkpoint, which hides it from the walk; torch gives b a gradient. With
    # trace() the parameters the checkpoint body used are known: no finding about b at all.
    run, report = _inspected(CUT_AND_REENTRANT, traced=True)
    assert not [f for f in report.findings if "b" in f.params]
    untraced = gradscope.inspect(run.root, params=run.params)     # untraced: a warning, never an error
    assert [f.severity for f in untraced.findings if "b" in f.params] == ["warning"]
    run.root.backward()
    assert run.params["b"].grad is not None
    check_program(CUT_AND_REENTRANT, traced=True, watched=True)


NO_GRAD_VIEW_ROOT = Program((("unsqueeze", 1, 0, "no_grad"),), (3,), "nonscalar")


def test_root_that_is_a_no_grad_view_of_a_parameter():
    # Found by the slow profile: a view of a leaf taken under no_grad says requires_grad=True but has
    # no grad_fn; torch's own get_gradient_edge asserted inside inspect(). Now a NoGradRootError, the
    # same verdict as backward() ("does not require grad"); next to a good root it is a finding.
    run = run_program(NO_GRAD_VIEW_ROOT)
    assert run.root.requires_grad and run.root.grad_fn is None
    with pytest.raises(gradscope.NoGradRootError, match="view of a parameter taken under torch.no_grad"):
        gradscope.inspect(run.root)
    assert backward_truth(run.root)["errors"] == ["nonscalar", "nograd"]
    report = gradscope.inspect([run.root, run.params["w"].sum()])
    assert [f.kind for f in report.findings] == ["no-grad-root"]
    check_program(NO_GRAD_VIEW_ROOT)
    check_program(Program(NO_GRAD_VIEW_ROOT.steps, (3, 1), "list"), traced=True, watched=True)


NO_GRAD_VIEW_OF_MODIFIED_BASE = Program((("view_t", 1, 0, "no_grad"), ("detach_mul_", 1, 0, "plain")),
                                        (3,), "sum")


def test_program_whose_root_torch_refuses_to_read():
    # Found by the slow profile (a harness case): a no_grad view whose base is later modified in place
    # cannot even have its grad_fn read. The executor leaves such roots out; inspect() raises
    # InputValueError on one (tests/walk/test_hostile.py).
    check_program(NO_GRAD_VIEW_OF_MODIFIED_BASE)


SPLIT_VIEW_BASE_MODIFIED = Program((("chunk", 2, 0, "plain"), ("add_", 2, 0, "no_grad")), (3,), "sum")


def test_saved_split_view_whose_base_is_modified_in_place():
    # Found by the slow profile: mul saved the two chunk() views of m, then m.add_() under no_grad.
    # torch refuses in backward with its multi-output-view message (no version in it), which the
    # version regex missed: no inplace-hazard was reported. Now the slot is stale.
    run = _one_hazard(SPLIT_VIEW_BASE_MODIFIED, "at an earlier version")
    with pytest.raises(RuntimeError, match="is a view and its base"):
        run.root.backward()
    check_program(SPLIT_VIEW_BASE_MODIFIED)


DEAD_REGION = Program((("exp", 1, 0, "ckpt_reentrant"), ("matmul", 0, 0, "ckpt_reentrant")), (3,), "sum")


def test_parameter_used_only_in_a_checkpoint_region_outside_the_graph_is_flagged():
    # Found by the CI fuzz profile (traced): w is used only inside a reentrant checkpoint whose
    # input needs no grad, so that region never joins the graph; another region does. The region of each
    # parameter is now its own node (the ctx of its CheckpointFunction.forward frame), not a guess by seq.
    run, report = _inspected(DEAD_REGION, traced=True)
    assert "w" in {p for f in report.findings if f.severity == "error" for p in f.params}
    assert "a" not in {p for f in report.findings for p in f.params}
    check_program(DEAD_REGION, traced=True, watched=True)


VIEW_IN_REGION = Program((("bmm", 0, 1, "ckpt_reentrant"),), (3,), "sum")


def test_parameter_viewed_inside_a_checkpoint_region_is_known():
    # Found by the slow profile (traced): bmm inside a reentrant checkpoint uses
    # u.unsqueeze(0), a view taken under no_grad; the view, not u, was recorded as the region's input.
    run, report = _inspected(VIEW_IN_REGION, traced=True)
    assert "u" not in {p for f in report.findings for p in f.params}
    check_program(VIEW_IN_REGION, traced=True, watched=True)
