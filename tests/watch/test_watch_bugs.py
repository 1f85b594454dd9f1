"""Bugs ``watch()`` must find at the right step with the right names; truth from torch (which ``.grad`` is
None or non-finite when the optimizer steps, what torch raises without gradscope)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import gradscope
from gradscope.watching import flow
from tests.watch._twins import twin


def test_internal_failure_is_one_warning_and_training_goes_on(monkeypatch):
    def broken(_tensors):
        raise RuntimeError("norms broke")

    monkeypatch.setattr(flow, "group_norms", broken)

    def build():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, i):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        guard = twin(build, step, steps=3)                           # gradients identical, nothing raised
    texts = [str(w.message) for w in said if "switched off" in str(w.message)]
    assert len(texts) == 1 and "gradient check failed" in texts[0] and "norms broke" in texts[0]
    assert guard.backwards == 1                                      # the check stopped after the failure


def test_user_callable_exception_goes_through():
    model = nn.Linear(3, 1)
    model.weight.requires_grad_(True)

    class Stop(Exception):
        pass

    def on_error(_findings):
        raise Stop("mine")

    with gradscope.watch(model, on_error=on_error):
        with pytest.raises(Stop):
            (model.bias * 2).sum().backward()                        # weight gets no gradient


class TwoTasks(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(4, 8)
        self.task1, self.task2 = nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x):
        h = self.trunk(x).relu()
        return self.task1(h), self.task2(h)


def test_head_without_gradient_is_named_at_the_optimizer_step():
    model = nn.ModuleDict({"trunk": nn.Linear(4, 8), "a": nn.Linear(8, 1), "b": nn.Linear(8, 1)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradscope.watch(model) as guard:
        for step in range(1, 4):
            opt.zero_grad()
            h = model["trunk"](torch.randn(3, 4))
            model["a"](h).sum().backward(retain_graph=True)
            (model["b"](h).sum() if step < 3 else h.sum()).backward()   # step 3: head b left out
            held_none = {n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()}
            if step < 3:
                opt.step()
        weight = model["b"].weight.detach().clone()
        with pytest.raises(gradscope.GradientError, match="checked at its step 3") as exc:
            opt.step()
    assert held_none == {"b.weight", "b.bias"}                      # torch: b's .grad is zero (set_to_none)
    assert {p for f in exc.value.findings for p in f.params} == held_none
    assert torch.equal(model["b"].weight, weight) and guard.backwards == 6


def test_without_an_optimizer_judged_per_backward_with_the_accumulate_hint():
    model = TwoTasks()
    with gradscope.watch(model), pytest.raises(gradscope.GradientError, match="accumulate=N") as exc:
        y1, _ = model(torch.randn(3, 4))
        y1.sum().backward()
    assert {p for f in exc.value.findings for p in f.params} == {"task2.weight", "task2.bias"}


def test_layer_replaced_after_the_optimizer_is_not_optimized():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with gradscope.watch(model) as guard:
            model[2] = nn.Linear(8, 1)                             # after the optimizer was built
            kinds_at = {}
            for step in range(1, 4):
                opt.zero_grad()
                model(torch.randn(3, 4)).sum().backward()
                before = model[2].weight.detach().clone()
                opt.step()
                assert model[2].weight.grad.abs().sum() > 0 and torch.equal(model[2].weight, before)   # torch
                kinds_at[step] = dict(guard.counts)
    assert kinds_at[1] == {} and kinds_at[2] == {"not-optimized": 2}
    texts = [str(w.message) for w in said if "not-optimized" in str(w.message)]
    assert len(texts) == 2 and "'2.weight'" in texts[0] and "'2.bias'" in texts[0]      # said once,
    assert "replaced after the optimizer was built" in texts[0]
    assert "summary over 3 backwards: not-optimized 4 times (2.bias, 2.weight)" in texts[1]   # then counted


def test_parameter_replaced_after_the_optimizer_is_not_optimized():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    with gradscope.watch(model, on_error=seen.extend):
        model[1].weight = nn.Parameter(torch.randn(1, 4))
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    assert [(f.kind, f.params) for f in seen] == [("not-optimized", ("1.weight",))]
