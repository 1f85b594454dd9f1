"""The step's absolute peak against torch.profiler over real training loops: what is alive when backward
starts (the batch no op saves, the loss's buffer, in-place writes, views of the batch), and the first
optimizer step against the ones after it (replay/steady.py NOTE [first and later steps]): three real steps
measured, with AdamW / SGD with momentum / no optimizer, ``zero_grad(set_to_none=True/False)`` and
gradient accumulation."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradscope
from gradscope.errors import InputTypeError, InputValueError
from tests._memtruth import measure
from tests._steptruth import measure_steps

TOL = 0.02


# -- what is alive when backward starts ------------------------------------------------------------------


class Shifted(nn.Module):
    """The batch is shifted in place before a 1-d convolution sees a view of it: no op saves the batch."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.norm = nn.LayerNorm(128)

    def forward(self, x):
        h = x + 1.0
        h.add_(0.5)
        return self.norm(self.conv(h.view(16, 4, 32)).reshape(16, 128)).sum()


class Classifier(nn.Module):
    """Elementwise ops on the batch that save nothing (its input needs no gradient), a head, a target
    buffer: only the head's input is saved."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(64, 10)
        self.register_buffer("y", torch.randint(0, 10, (16,)))

    def forward(self, x):
        h = x * x * 0.1 + 1.0
        h += 1.0
        return F.cross_entropy(self.head(h), self.y)


class Regressor(nn.Module):
    """A residual linear, exp then clamp, an MSE loss whose scalar views a batch-sized buffer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.register_buffer("y", torch.randn(32, 32))

    def forward(self, x):
        h = x * 1.0
        h = (h + self.lin(h)).exp().clamp(max=10.0)
        return F.mse_loss(h, self.y)


class Tokens(nn.Module):
    """An embedding saves its indices: the batch is an activation, counted once."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)

    def forward(self, x):
        h = self.emb(x).view(32, 2, 8).permute(1, 0, 2).sum(0).repeat(1, 2)
        return (h * 1.5).logsumexp(-1).mean()


BASES = {"shifted": (Shifted, lambda: torch.randn(16, 128)), "classifier": (Classifier, lambda: torch.randn(16, 64)),
         "regressor": (Regressor, lambda: torch.randn(32, 32)),
         "tokens": (Tokens, lambda: torch.randint(0, 50, (32,)))}


def _base_truth(name, how, grad_set):
    """One step measured, the prediction taken between forward and backward: ``how`` is ``"traced"``
    (the batch recorded by trace()), ``"inputs"`` (passed as inputs=) or ``"neither"``."""
    cls, make = BASES[name]
    torch.manual_seed(0)
    model, x = cls(), make()
    if grad_set:
        model(x).backward()
    traces = []

    def forward():
        if how == "traced":
            with gradscope.trace() as tr:
                loss = model(x)
            traces.append(tr)
            return loss, model
        return model(x), model

    kw = {"inputs": [x]} if how == "inputs" else {}

    def inspect(loss, m):
        return gradscope.inspect(loss, model=m, trace=traces[-1] if traces else None)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inspect(*forward()).backward_memory(**kw)  # the in-node cache is not measured under a profiler
        return measure(forward, inspect=inspect, predict=lambda r, o: r.backward_memory(**kw), before=[x]), x


@pytest.mark.parametrize("name,grad_set", [("shifted", True), ("classifier", False), ("regressor", False),
                                           ("tokens", True)])
def test_the_batch_no_op_saves_is_alive_when_backward_starts(name, grad_set):
    """Traced, the batch the model was called with is counted once, whether or not an op saved it (as when
    it is passed as inputs=); the absolute peak is then the profiler's. Neither traced nor given, it is
    named as not counted, and the peak is low by at most the batch."""
    traced, x = _base_truth(name, "traced", grad_set)
    given, _ = _base_truth(name, "inputs", grad_set)
    neither, _ = _base_truth(name, "neither", grad_set)
    for t in (traced, given):
        assert t.prediction.absolute_peak == pytest.approx(t.absolute_peak, rel=0.005), name
        assert t.prediction.base == pytest.approx(t.before + t.at_backward, abs=64), name
        assert not t.prediction.uncounted
    assert traced.prediction.parts == given.prediction.parts
    saved = name == "tokens"  # the embedding saved its indices: among the activations, not again
    assert traced.prediction.parts.get("batch", 0) == (0 if saved else x.nbytes)
    bm = neither.prediction
    assert bm.uncounted and "inputs=" in bm.uncounted[0] and "can be low by the rest of it" in str(bm)
    assert neither.absolute_peak - bm.absolute_peak == pytest.approx(0 if saved else x.nbytes, abs=64)
    rows = dict(traced.prediction.table())
    assert rows.get("batch", 0) == traced.prediction.parts.get("batch", 0)  # printed in the step table


def test_the_traced_batch_keeps_no_reference_to_it():
    import gc
    import weakref

    model = Classifier()
    x = torch.randn(16, 64)
    with gradscope.trace() as tr:
        loss = model(x)
    ref = weakref.ref(x)
    assert weakref.getweakrefcount(x) == 1  # ours only: the trace holds none (torch.utils.swap_tensors)
    bm = gradscope.inspect(loss, model=model, trace=tr).backward_memory()
    assert bm.parts["batch"] == x.nbytes
    del x
    gc.collect()
    assert ref() is None


# -- the first step and the later ones ------------------------------------------------------------------


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.LayerNorm(64), nn.Linear(64, 8))


_OPTS = {"adamw": lambda m: torch.optim.AdamW(m.parameters()),
         "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
         "none": lambda m: None}


def _steps(opt_name, set_to_none, accumulate, warm=False):
    """Three optimizer steps measured, the prediction taken at step 1 between forward and backward."""
    model = _mlp()
    x = torch.randn(32, 64)
    opt = _OPTS[opt_name](model)
    if warm and opt is not None:  # the prediction is asked at a step after the first
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    traces = []

    def loss_fn(m, batch):
        with gradscope.trace() as tr:
            loss = m(batch).pow(2).mean()
        traces.append(tr)
        return loss

    def predict(loss):
        report = gradscope.inspect(loss, model=model, trace=traces[-1])
        return report.backward_memory(optimizer=opt, accumulate=accumulate, set_to_none=set_to_none)

    predict(loss_fn(model, x))  # the in-node cache is not measured under a profiler
    return measure_steps(model, lambda s, k: (x,), loss_fn, opt, steps=3, accumulate=accumulate,
                         set_to_none=set_to_none, before=[x], predict=predict)


GRID = list(itertools.product(_OPTS, (True, False), (1, 2)))
FAST = [("adamw", True, 1), ("adamw", False, 2), ("sgd_momentum", True, 2), ("none", False, 1)]


def _check_steps(opt_name, set_to_none, accumulate, warm=False):
    truth = _steps(opt_name, set_to_none, accumulate, warm)
    bm = truth["prediction"]
    first, later = truth["steps"][0], max(truth["steps"][1:])
    where = (opt_name, set_to_none, accumulate, warm, truth["steps"], bm.first_step, bm.later_step)
    assert bm.first_step.absolute_peak == pytest.approx(first, rel=TOL, abs=64), where
    assert bm.later_step.absolute_peak == pytest.approx(later, rel=TOL, abs=64), where
    assert bm.absolute_peak == max(bm.first_step.absolute_peak, bm.later_step.absolute_peak)
    assert bm.absolute_peak == pytest.approx(max(truth["steps"]), rel=TOL, abs=64), where
    return truth, bm


@pytest.mark.parametrize("opt_name,set_to_none,accumulate", FAST)
def test_first_and_later_steps_match_three_real_steps(opt_name, set_to_none, accumulate):
    truth, bm = _check_steps(opt_name, set_to_none, accumulate)
    if opt_name == "adamw" and set_to_none and accumulate == 1:
        # AdamW's state alive with the activations: the later step's backward is higher than step 1's
        assert bm.later_step.backward_peak - bm.first_step.backward_peak == bm.later_step.parts["optimizer state"]
    if opt_name == "none" and not set_to_none:  # .grad kept as zeros: higher from step 2 on
        assert truth["steps"][1] > truth["steps"][0] and bm.later_step.absolute_peak > bm.first_step.absolute_peak
    text = str(bm)
    assert "first step (" in text and "later steps (" in text and "absolute peak of the step:" in text
    rows = dict(bm.table())
    assert rows["peak of the first step"] == bm.first_step.absolute_peak
    assert rows["peak of a later step"] == bm.later_step.absolute_peak
    assert rows["absolute peak of the step"] == bm.absolute_peak
    assert rows["later steps: alive when backward starts"] == sum(bm.later_step.parts.values())


@pytest.mark.slow
@pytest.mark.parametrize("opt_name,set_to_none,accumulate", GRID)
@pytest.mark.parametrize("warm", [False, True])
def test_first_and_later_steps_grid(opt_name, set_to_none, accumulate, warm):
    _check_steps(opt_name, set_to_none, accumulate, warm)


def test_asked_at_a_later_step_both_steps_are_the_same():
    """Asked after the first optimizer step, the step as inspected is already a later one."""
    truth, bm = _check_steps("adamw", True, 1, warm=True)
    assert bm.first_step.absolute_peak == bm.later_step.absolute_peak


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_accumulate_must_be_a_positive_int(bad):
    model = _mlp()
    report = gradscope.inspect(model(torch.randn(2, 64)).sum(), model=model)
    with pytest.raises(InputValueError, match="accumulate="):
        report.backward_memory(accumulate=bad)
    with pytest.raises(InputTypeError, match="set_to_none="):
        report.backward_memory(set_to_none="yes")
