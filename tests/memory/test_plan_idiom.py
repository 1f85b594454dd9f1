"""Plans in the user's idiom (memory/planning/idiom.py), each checked against torch: a Hugging Face model's
own switch (applied for real and measured with torch.profiler), a contiguous range instead of a list with
holes, and the note when the peak sits at the loss."""

from __future__ import annotations

import warnings

import pytest
import torch

import gradscope
from gradscope.memory.planning.idiom import contiguous
from gradscope.memory.planning.plancode import _names_expr, plan_code, span_names
from tests._plan_models import encoder
from tests._steptruth import apply_changes, measure_step

transformers = pytest.importorskip("transformers")
TOL = 0.02


def _gpt2(vocab, d, layers=4):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=d, n_head=4, vocab_size=vocab, n_positions=128,
                                  use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    return model, torch.randint(0, vocab, (4, 128))


def _lm_loss(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def _traced(vocab, d):
    model, ids = _gpt2(vocab, d)
    with gradscope.trace(model) as tr:
        loss = _lm_loss(model, ids)
    return gradscope.inspect(loss, model=model, trace=tr), model, ids, loss


def test_a_plan_that_amounts_to_the_hf_switch_says_it_and_the_switch_measures_as_predicted():
    report, model, ids, loss = _traced(1000, 128)
    layers = [f"transformer.h.{i}" for i in range(4)]
    assert report.graph.graph["hf_checkpointing"]["layers"] == layers
    before = report.what_if().peak
    plan = report.plan(budget=int(before * 0.43))       # tight enough that every block is needed
    assert plan.fits and plan.checkpoint == layers
    assert plan.code.startswith("model.activation_checkpointing_enable()") or plan.code.startswith(
        "model.gradient_checkpointing_enable(")
    assert "checkpoint: transformer.h[0:4]" in str(plan) and "get_submodule" not in plan.code
    state = {k: v.clone() for k, v in model.state_dict().items()}
    del report, loss
    old = 'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})'
    for code in (plan.code, old):
        fresh, _ = _gpt2(1000, 128)
        fresh.load_state_dict(state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)          # the old name, deprecated in transformers 5
            exec(code, {"model": fresh})
        measured = measure_step(fresh, (ids,), _lm_loss)["peak"]
        assert abs(plan.peak - measured) <= TOL * measured, (code, plan.peak, measured)
        assert measured <= plan.budget


def test_a_cheaper_plan_inside_the_layers_mentions_the_switch_with_its_numbers():
    report, *_ = _traced(1000, 128)
    before = report.what_if().peak
    plan = report.plan(budget=int(before * 0.8))
    assert plan.fits and all(c.startswith("transformer.h.") for c in plan.checkpoint)
    every = report.what_if(checkpoint=[f"transformer.h.{i}" for i in range(4)])
    note = next(n for n in plan.notes if "own switch" in n)
    assert f"{gradscope._format.human_bytes(every.peak)} (fits)" in note
    assert f"+{every.recompute_share:.0%} forward FLOPs" in note


def test_the_peak_at_a_large_vocabulary_loss_is_said():
    report, model, ids, loss = _traced(8000, 32)
    bm = report.backward_memory()
    assert bm.names[bm.order.index(bm.peak_node)] == "LogSoftmaxBackward0"
    plan = report.plan(budget=int(report.what_if().peak * 0.9))
    note = next(n for n in plan.notes if "chunked cross-entropy" in n)
    logits = model(input_ids=ids, use_cache=False).logits
    assert "LogSoftmaxBackward0" in note and "512×8000" in note
    assert gradscope._format.human_bytes(logits.nbytes) in note      # one logits-shaped tensor, as torch has it
    small, *_ = _traced(1000, 128)                                  # checkpointing buys more there: no note
    assert not any("chunked" in n for n in small.plan(budget=int(small.what_if().peak * 0.8)).notes)


def test_a_list_with_holes_becomes_a_range_when_it_costs_the_same():
    torch.manual_seed(0)
    model, inputs, loss_fn = encoder(layers=6)
    with gradscope.trace(model) as tr:
        loss = loss_fn(model, *inputs)
    report = gradscope.inspect(loss, model=model, trace=tr)
    holes = ["layers.0", "layers.2", "layers.4"]
    first = report.what_if(checkpoint=holes)
    target = int(first.peak * 1.01)
    chosen, best = contiguous(holes, [], first, lambda ck, off, wi=report.what_if: wi(checkpoint=ck), target,
                              {f"layers.{i}" for i in range(6)})
    assert sorted(chosen) == ["layers.0", "layers.1", "layers.2"] and best.peak <= target
    assert best.recompute_flops <= first.recompute_flops * 1.01
    assert span_names(chosen) == "layers[0:3]" and 'for i in range(0, 3)' in plan_code(chosen, [])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    del report, loss
    torch.manual_seed(0)
    fresh, inputs, loss_fn = encoder(layers=6)
    fresh.load_state_dict(state)
    apply_changes(fresh, chosen)
    measured = measure_step(fresh, inputs, loss_fn)["peak"]
    assert abs(best.peak - measured) <= TOL * measured


def test_ranges_in_names_and_code():
    names = [f"transformer.h.{i}.mlp.act" for i in range(2, 7)]
    assert span_names(names + ["lm_head"]) == "transformer.h[2:7].mlp.act, lm_head"
    assert eval(_names_expr(names)) == names
    assert span_names(["a.1", "a.2", "a.4"]) == "a.1, a.2, a.4"     # two in a row stay a list
