"""A loss that is already infinite or NaN: watch says so first and names the forward op that made it
(``log`` of a softmax that underflowed to 0, a division by 0), with its line and the stable form. Truth:
torch itself (the loss is not finite, ``.grad`` holds NaN, ``detect_anomaly()`` names a backward op of
that path); the healthy twin (``log_softmax``) stays finite and clean.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradscope


def _line(marker):
    with open(__file__, encoding="utf-8") as f:
        for i, text in enumerate(f, 1):
            if text.rstrip().endswith(marker):
                return f"test_watch_nan_loss.py:{i}"
    raise AssertionError(marker)


class LogSoftmax(nn.Module):
    def __init__(self, stable=False):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.stable = stable

    def forward(self, x):
        logits = self.a(x) * 1000  # confident logits: softmax underflows to exactly 0
        if self.stable:
            return -F.log_softmax(logits, -1)[:, 0].mean()
        return -torch.log(torch.softmax(logits, -1))[:, 0].mean()  # op: log-softmax


class Ratio(nn.Module):
    def __init__(self, eps=0.0):
        super().__init__()
        self.a = nn.Linear(4, 1)
        self.b = nn.Linear(4, 1)
        self.eps = eps

    def forward(self, x):
        num = self.a(x)
        den = torch.relu(self.b(x) * 0 - 1) + self.eps  # always 0 (+ eps)
        return (num / den).abs().mean()  # op: ratio


def _anomaly_op(model, x) -> str:
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.detect_anomaly(), pytest.raises(RuntimeError) as exc:
            model(x).backward()
    return re.search(r"Function '(\w+)' returned nan", str(exc.value)).group(1)


def _watched(model, x, steps=2):
    seen = []
    with gradscope.watch(model, on_error=seen.append):
        for _ in range(steps):
            model.zero_grad()
            loss = model(x)
            loss.backward()
    return seen, loss


@pytest.mark.parametrize(
    "cls,op,value,fix",
    [(LogSoftmax, "log", "inf", "torch.log_softmax"), (Ratio, "div", "inf", "eps")],
    ids=["log-softmax", "division"],
)
def test_an_infinite_loss_is_said_first_with_the_op_that_made_it(cls, op, value, fix):
    torch.manual_seed(0)
    model, x = cls(), torch.randn(8, 4)
    seen, loss = _watched(model, x)
    assert not torch.isfinite(loss).item() and str(loss.item()) == value  # torch: the loss itself
    bad = {n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()}
    assert bad  # torch: the gradients are not finite
    second = seen[1]
    assert {p for f in second for p in f.params} == bad
    marker = "# op: log-softmax" if cls is LogSoftmax else "# op: ratio"
    for f in second:
        assert f.kind == "nonfinite-grad" and f.location == _line(marker)
        origin = f.message[f.message.index("The loss itself"):]
        assert origin.startswith(f"The loss itself is {value}, made in the forward by {op} at {_line(marker)}")
        assert fix in origin and "born in the forward" in origin
        assert origin.index("The loss itself") < origin.index("born in the forward")
    truth = _anomaly_op(model, x)
    assert truth in second[0].message  # the op anomaly mode names is still said


@pytest.mark.parametrize("make", [lambda: LogSoftmax(stable=True), lambda: Ratio(eps=1e-3)], ids=["log-softmax", "eps"])
def test_the_stable_twins_are_finite_and_clean(make):
    torch.manual_seed(0)
    model, x = make(), torch.randn(8, 4)
    seen, loss = _watched(model, x)
    assert torch.isfinite(loss).item() and all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert seen == []
