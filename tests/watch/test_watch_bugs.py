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
