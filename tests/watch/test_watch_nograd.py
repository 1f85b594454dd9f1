"""A module whose forward ran with grad disabled: watch() names it and the line, instead of the list of
likely causes (truth: torch leaves its parameters' .grad None)."""

from __future__ import annotations

import inspect

import pytest
import torch

import gradscope
from gradscope.errors import GradientError


class Frozen(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def forward(self, x):
        with torch.no_grad():
            h = self.embed(x)  # the planted bug
        return self.head(h)


BUG_LINE = f"{__name__.rpartition('.')[2]}.py:{inspect.getsourcelines(Frozen.forward)[1] + 2}"


def _step(model, opt):
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()


def test_a_module_run_under_no_grad_is_named_with_its_line():
    model = Frozen()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradscope.watch(model), pytest.raises(GradientError) as err:
        _step(model, opt)
    assert model.embed.weight.grad is None and model.head.weight.grad is not None  # torch's truth
    text = str(err.value)
    assert "Module 'embed' ran with grad disabled" in text and BUG_LINE in text
    assert "Likely causes" not in text  # the known cause replaces the list


def test_each_finding_says_the_cause_in_warn_mode():
    model, found = Frozen(), []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradscope.watch(model, on_error=found.extend):
        _step(model, opt)
    assert sorted(p for f in found for p in f.params) == ["embed.bias", "embed.weight"]
    assert all(BUG_LINE in f.message and "Likely causes" not in f.message for f in found)


def test_an_evaluation_under_no_grad_between_steps_is_not_a_cause():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradscope.watch(model) as guard:
        for _ in range(3):
            _step(model, opt)
            with torch.no_grad():
                model(torch.randn(2, 4))  # validation: healthy
    assert all(p.grad is not None for p in model.parameters()) and not guard.findings


def test_a_module_run_with_grad_after_a_no_grad_call_is_not_blamed():
    # The same module run without grad and then with grad in one step: the latest call counts.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradscope.watch(model) as guard:
        opt.zero_grad()
        with torch.no_grad():
            model[0](torch.randn(2, 4))
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    assert model[0].weight.grad is not None and not guard.findings
