"""Five random programs whose absolute step peak was once predicted low by 6-28% (what was alive when backward
started was under-counted; the backward's own rise agreed), each in the setting it was found in, against
torch.profiler: the bytes alive before the forward (each storage once) plus the highest running sum from the
start of backward to the end of the step (``tests._memtruth.measure``), and three real steps of the loop
(``tests._steptruth.measure_steps``). The batch traced or passed as ``inputs=`` is counted: step 1 and the
steady state within 2%; neither traced nor given, the answer is within 2% or labelled (``bm.uncounted``)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradscope
from tests._memtruth import measure
from tests._steptruth import measure_steps

TOL = 0.02


class Shifted(nn.Module):  # seed 90098: .grad set, no retain_graph, not traced, no optimizer (-13.48%)
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(4, 4, 3, padding=1)
        self.ln2 = nn.LayerNorm(128)

    def forward(self, x):
        h = x + 1.0
        h.add_(0.5)
        return self.ln2(self.conv1(h.view(16, 4, 32)).reshape(16, 128)).sum()


class Scaled(nn.Module):  # seed 90135: .grad set, retain_graph, traced, SGD momentum (-10.80%)
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(16, 16, bias=True)

    def forward(self, x):
        h = self.lin1(x.unsqueeze(0).squeeze(0) * 2)
        h.mul_(0.5)
        return h.sum()


class Classifier(nn.Module):  # seed 90146: .grad empty, retain_graph, not traced, no optimizer (-27.65%)
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(64, 10)
        self.register_buffer("y", torch.randint(0, 10, (16,)))

    def forward(self, x):
        h = x * x * 0.1
        h = h + 1.0
        h += 1.0
        return F.cross_entropy(self.head(h), self.y)


class Regressor(nn.Module):  # seed 90162: .grad empty, no retain_graph, not traced, no optimizer (-12.07%)
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(32, 32, bias=True)
        self.register_buffer("y", torch.randn(32, 32))

    def forward(self, x):
        h = x * 1.0
        h = h + self.lin1(h)
        return F.mse_loss(h.exp().clamp(max=10.0), self.y)


class Tokens(nn.Module):  # seed 90241: .grad set, retain_graph, not traced, no optimizer (-6.39%)
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)

    def forward(self, x):
        h = self.emb(x).view(32, 2, 8).permute(1, 0, 2).sum(0).repeat(1, 2)
        h = h * 1.5
        h.retain_grad()
        return h.logsumexp(-1).mean()


#: seed -> (model, batch, .grad set, retain_graph, traced, optimizer)
REPROS = {
    90098: (Shifted, lambda: torch.randn(16, 128), True, False, False, None),
    90135: (Scaled, lambda: torch.randn(8, 16), True, True, True, "sgdm"),
    90146: (Classifier, lambda: torch.randn(16, 64), False, True, False, None),
    90162: (Regressor, lambda: torch.randn(32, 32), False, False, False, None),
    90241: (Tokens, lambda: torch.randint(0, 50, (32,)), True, True, False, None),
}


def _setup(seed):
    cls, make, grad_set, retain, traced, opt_name = REPROS[seed]
    torch.manual_seed(seed)
    model, x = cls(), make()
    if grad_set:
        model(x).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt_name == "sgdm" else None
    return model, x, retain, traced, opt


def _one_step(seed, given: bool):
    model, x, retain, traced, opt = _setup(seed)
    traces = []

    def forward():
        if traced:
            with gradscope.trace() as tr:
                loss = model(x)
            traces.append(tr)
            return loss, model
        return model(x), model

    def inspect(loss, m):
        return gradscope.inspect(loss, model=m, trace=traces[-1] if traces else None)

    kw = {"inputs": [x]} if given else {}

    def predict(report, o):
        return report.backward_memory(optimizer=o, retain_graph=retain, **kw)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, m = forward()
        predict(inspect(loss, m), opt)  # the in-node cache is not measured under a profiler
        del loss
        return measure(forward, inspect=inspect, predict=predict, optimizer=opt, retain_graph=retain, before=[x])


def _three_steps(seed, given: bool):
    model, x, retain, traced, opt = _setup(seed)
    traces = []

    def loss_fn(m, batch):
        if traced:
            with gradscope.trace() as tr:
                loss = m(batch)
            traces.append(tr)
            return loss
        return m(batch)

    def predict(loss):
        report = gradscope.inspect(loss, model=model, trace=traces[-1] if traces else None)
        return report.backward_memory(optimizer=opt, retain_graph=retain, **({"inputs": [x]} if given else {}))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return measure_steps(model, lambda s, k: (x,), loss_fn, opt, steps=3, before=[x], retain_graph=retain,
                             predict=predict)


#: Not modelled yet, with the measured numbers (strict: a fix turns them into failures to remove from here).
MISSES = {
    90241: "h.retain_grad() keeps a copy of h's gradient as h.grad (retain_grad's hook clones it; the graph keeps h "
           "with retain_graph=True): the measured level stays 2,048 B above the replay from MulBackward0 to the "
           "end, the step peak 16,144 B measured, 15,112 B predicted (-6.39%), not labelled. The flag is readable "
           "on the saved tensor (LogsumexpBackward0's saved self: .retains_grad) but the walk does not read it",
}


@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.xfail(strict=True, reason=MISSES[s]))
                                  if s in MISSES else s for s in sorted(REPROS)])
def test_handed_over_program_agrees_on_the_step_peak(seed):
    one = _one_step(seed, given=True)
    bm = one.prediction
    assert not bm.uncounted, bm.uncounted
    assert abs(bm.first_step.absolute_peak - one.absolute_peak) <= TOL * one.absolute_peak, (
        seed, bm.first_step.absolute_peak, one.absolute_peak, str(bm))
    loop = _three_steps(seed, given=True)
    bm3, steps = loop["prediction"], loop["steps"]
    assert abs(bm3.first_step.absolute_peak - steps[0]) <= TOL * steps[0], (seed, bm3.first_step, steps)
    assert abs(bm3.absolute_peak - max(steps)) <= TOL * max(steps), (seed, bm3.later_step, steps)


@pytest.mark.parametrize("seed", sorted(REPROS))
def test_handed_over_program_without_the_batch_is_exact_or_labelled(seed):
    one = _one_step(seed, given=False)
    bm = one.prediction
    err = (bm.first_step.absolute_peak - one.absolute_peak) / one.absolute_peak
    assert err >= -TOL or bm.uncounted, (seed, err, str(bm))
    assert err <= TOL, (seed, err)
