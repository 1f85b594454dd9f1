"""Will it fit" answers for the steady state, proven over real training loops: ``what_if``, ``plan`` and
``max_batch`` with AdamW compare the higher of step 1 and a later step with the budget (replay/steady.py
NOTE [first and later steps]); the plan's printed code and the largest batch are applied for real and three
steps of the loop measured with torch.profiler (``tests._steptruth.measure_steps``): the later steps, where
AdamW's state is alive from the start, stay under the budget. ``accumulate=`` and ``set_to_none=False`` flow
through all of them and the CLI gate."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

import gradscope
from gradscope.cli.commands import main
from gradscope.errors import InputValueError
from tests._plan_models import gpt, gpt_tiny
from tests._steptruth import measure_steps

TOL = 0.02


def _traced(build, batch=None):
    torch.manual_seed(0)
    model, inputs, loss_fn = build() if batch is None else build(batch)
    opt = torch.optim.AdamW(model.parameters())
    with gradscope.trace(model) as tr:
        loss = loss_fn(model, *inputs)
    return gradscope.inspect(loss, model=model, trace=tr), model, opt, loss


def _loop(build, state, batch=None, code=None, accumulate=1, set_to_none=True) -> list[int]:
    """The absolute peak of each of three real AdamW steps of ``build``'s loop, ``code`` executed first."""
    torch.manual_seed(0)
    model, inputs, loss_fn = build() if batch is None else build(batch)
    model.load_state_dict(state)
    if code is not None:
        exec(code, {"model": model})
    opt = torch.optim.AdamW(model.parameters())
    return measure_steps(model, lambda s, k: inputs, loss_fn, opt, steps=3, accumulate=accumulate,
                         set_to_none=set_to_none, before=inputs)["steps"]


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_plan_with_adamw_fits_the_later_steps_as_measured():
    """A budget step 1 fits without a plan and the later steps do not: the plan is made for the later steps,
    and its code, executed as printed, keeps every measured step under the budget."""
    report, model, opt, loss = _traced(gpt)
    wi = report.what_if(optimizer=opt)
    first, later = wi.first_step.absolute_peak, wi.later_step.absolute_peak
    assert later > first and wi.peak == later and wi.step == "later steps"
    budget = (first + later) // 2  # step 1 alone would be told it fits
    p = report.plan(budget=budget, optimizer=opt)
    assert p.before == later and p.checkpoint and p.fits and p.peak <= budget, str(p)
    assert p.result.later_step.absolute_peak == p.peak and "later steps" in str(p)
    state = _state(model)
    del report, loss
    plain = _loop(gpt, state)
    assert plain[0] <= budget < max(plain[1:]), plain  # the step-1 answer would have run out of memory at step 2
    steps = _loop(gpt, state, code=p.code)
    assert max(steps) <= budget, (str(p), steps)
    assert abs(p.peak - max(steps)) <= TOL * max(steps), (p.peak, steps)


def test_max_batch_with_adamw_is_the_later_steps_limit():
    report, model, opt, loss = _traced(gpt_tiny)
    budget = int(report.what_if(batch=2.5, optimizer=opt).peak / 0.98) + 1  # batch 10 fits, 2% under
    mb = report.max_batch(budget=budget, optimizer=opt)
    assert mb.batch == 10 and mb.peak <= 0.98 * budget and mb.step == "later steps"
    assert mb.first_peak < mb.later_peak == mb.peak and "later steps" in str(mb)
    state = _state(model)
    del report, loss
    steps = _loop(gpt_tiny, state, batch=mb.batch)
    assert max(steps) <= budget and abs(mb.peak - max(steps)) <= TOL * max(steps), (mb, steps)


@pytest.mark.parametrize("accumulate,set_to_none", [(2, True), (1, False), (2, False)])
def test_accumulate_and_kept_grads_flow_through_what_if_and_plan(accumulate, set_to_none):
    report, model, opt, loss = _traced(gpt_tiny)
    kw = {"accumulate": accumulate, "set_to_none": set_to_none}
    wi = report.what_if(checkpoint=["blocks.*"], optimizer=opt, **kw)
    plain = report.what_if(checkpoint=["blocks.*"], optimizer=opt)
    assert wi.peak > plain.peak  # micro-steps 2..k (or every step) run with .grad set
    assert f"{accumulate} micro-steps" in str(wi) if accumulate > 1 else "set_to_none=False" in str(wi)
    p = report.plan(budget=int(wi.peak * 1.5), optimizer=opt, **kw)
    assert p.fits and not p.checkpoint and p.peak == report.what_if(optimizer=opt, **kw).peak
    mb = report.max_batch(budget=int(wi.peak * 2), optimizer=opt, checkpoint=["blocks.*"], **kw)
    assert mb.batch >= 4
    state = _state(model)
    code = "\n".join(
        ["from functools import partial", "from torch.utils.checkpoint import checkpoint",
         "for i in range(2):",
         "    m = model.get_submodule(f'blocks.{i}')",
         "    m.forward = partial(checkpoint, m.forward, use_reentrant=False)"])
    del report, loss
    steps = _loop(gpt_tiny, state, code=code, **kw)
    assert abs(wi.first_step.absolute_peak - steps[0]) <= TOL * steps[0], (str(wi), steps)
    assert abs(wi.peak - max(steps)) <= TOL * max(steps), (str(wi), steps)


def test_sharded_fsdp_refuses_what_it_does_not_model():
    report, _, opt, _loss = _traced(gpt_tiny)
    with pytest.raises(InputValueError, match="accumulate="):
        report.what_if(optimizer=opt, shard=gradscope.FSDP(2, modules=["blocks.*"]), accumulate=2)
    ddp = report.what_if(optimizer=opt, shard=gradscope.DDP(2), accumulate=2)
    assert ddp.peak > report.what_if(optimizer=opt, shard=gradscope.DDP(2)).peak


def test_cli_gate_compares_the_later_steps_with_the_budget():
    from tests.memory._plan_target import make

    report_loss, model = make()
    opt = torch.optim.AdamW(model.parameters())
    bm = gradscope.inspect(report_loss, model=model).backward_memory(optimizer=opt)
    first, later = bm.first_step.absolute_peak, bm.later_step.absolute_peak
    assert first < later
    target = "tests/memory/_plan_target.py:make"
    runner = CliRunner()
    mid = runner.invoke(main, ["memory", target, "--optimizer", "adamw", "--budget", str((first + later) // 2)])
    assert mid.exit_code == 1, mid.output  # step 1 fits, the later steps do not: the step does not fit
    assert "does NOT fit" in mid.output and "the later steps'" in mid.output and "step 1" in mid.output
    ok = runner.invoke(main, ["memory", target, "--optimizer", "adamw", "--budget", str(later + 1024)])
    assert ok.exit_code == 0 and "fits" in ok.output, ok.output
    acc = runner.invoke(main, ["memory", target, "--optimizer", "adamw", "--accumulate", "2", "--keep-grads",
                               "--budget", str(later + 1024)])
    assert acc.exit_code == 1 and "2 micro-steps" in acc.output, acc.output  # more than one backward's worth
    bad = runner.invoke(main, ["memory", target, "--accumulate", "0"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
