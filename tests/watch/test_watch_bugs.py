"""Bugs ``watch()`` must find at the right step with the right names; truth from torch (which ``.grad`` is
None or non-finite when the optimizer steps, what torch raises without gradscope)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import gradscope
from gradscope.watching import flow
from tests._zoo import TwoTasks
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


@pytest.mark.parametrize("where, check", [
    ("gradscope.watching.graphs.GraphWatch._pre", "graphs"),              # the forward pre-hook
    ("gradscope.watching.graphs.GraphWatch._post", "graphs"),             # the forward post-hook
    ("gradscope.watching.nanparams.NonfiniteParams.before_forward", "forward"),
    ("gradscope.watching.stepping.StepJudge._judge", "optimizer step"),   # inside optimizer.step()
    ("gradscope.watching.nograd.NoGradCalls._record", "no-grad modules"), # a forward under no_grad
])
def test_internal_failure_anywhere_is_one_warning(monkeypatch, where, check):
    def broken(*_args, **_kwargs):
        raise RuntimeError("bookkeeping broke")

    monkeypatch.setattr(where, broken)

    def build():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, i):
        opt.zero_grad()
        with torch.no_grad():
            model(torch.randn(2, 4))                                  # an evaluation
        model(torch.randn(2, 4)).sum().backward()
        opt.step()

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        guard = twin(build, step, steps=3)                           # gradients identical, nothing raised
    texts = [str(w.message) for w in said]
    assert len(texts) == 1 and f"its {check} check failed" in texts[0] and "bookkeeping broke" in texts[0]
    assert guard.checks == 3                                         # the gradient checks went on


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


@pytest.mark.parametrize("set_to_none", [True, False])
def test_head_without_gradient_is_named_at_the_optimizer_step(set_to_none):
    model = nn.ModuleDict({"trunk": nn.Linear(4, 8), "a": nn.Linear(8, 1), "b": nn.Linear(8, 1)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradscope.watch(model) as guard:
        for step in range(1, 4):
            opt.zero_grad(set_to_none=set_to_none)                   # False: b keeps a stale zero .grad
            h = model["trunk"](torch.randn(3, 4))
            model["a"](h).sum().backward(retain_graph=True)
            (model["b"](h).sum() if step < 3 else h.sum()).backward()   # step 3: head b left out
            held_none = {n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()}
            if step < 3:
                opt.step()
        weight = model["b"].weight.detach().clone()
        with pytest.raises(gradscope.GradientError, match="checked at its step 3") as exc:
            opt.step()
    assert held_none == {"b.weight", "b.bias"}                      # torch: b's .grad is None or stale zero
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


class StatefulLSTM(nn.Module):
    """Keeps its (h, c) in an attribute between calls; ``detach`` says whether it cuts the graph."""

    def __init__(self, detach):
        super().__init__()
        self.cell, self.head = nn.LSTMCell(3, 8), nn.Linear(8, 1)
        self.detach, self.state = detach, None

    def forward(self, x):
        if self.state is None:
            self.state = (torch.zeros(x.shape[0], 8), torch.zeros(x.shape[0], 8))
        h, c = self.cell(x, self.state)
        self.state = (h.detach(), c.detach()) if self.detach else (h, c)
        return self.head(h)


def _torch_error(model_fn, steps):
    """What torch itself raises on this loop (no gradscope): (step, message) or None."""
    torch.manual_seed(0)
    model, step = model_fn()
    for i in range(1, steps + 1):
        try:
            step(model, i)
        except RuntimeError as e:
            return i, str(e)
    return None


def _lstm(detach):
    model = StatefulLSTM(detach)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(m, i):
        opt.zero_grad()
        m(torch.randn(2, 3)).pow(2).mean().backward()
        opt.step()

    return model, step


def test_stateful_lstm_state_carried_in_an_attribute():
    truth = _torch_error(lambda: _lstm(False), 3)
    assert truth is not None and truth[0] == 2 and "second time" in truth[1]
    torch.manual_seed(0)
    model, step = _lstm(False)
    with gradscope.watch(model):
        step(model, 1)
        with pytest.raises(gradscope.GradientError, match="attribute 'state\\[0\\]' of the model") as exc:
            step(model, 2)                                           # where torch raised, with our words
    (f,) = exc.value.findings
    assert f.kind == "carried-graph" and {"cell.weight_ih", "cell.weight_hh"} <= set(f.params)
    assert "second time" in str(exc.value) and "detach" in f.message


def test_spiking_membrane_buffer_carried_without_an_optimizer():
    class Spiking(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 4)
            self.register_buffer("mem", torch.zeros(2, 4))

        def forward(self, x):
            self.mem = 0.9 * self.mem + self.fc(x)                    # no detach between steps: the bug
            return torch.sigmoid(self.mem)

    def make():
        model = Spiking()

        def step(m, i):
            m.zero_grad()
            m(torch.randn(2, 3)).sum().backward()

        return model, step

    truth = _torch_error(make, 3)
    assert truth is not None and truth[0] == 2
    torch.manual_seed(0)
    model, step = make()
    with gradscope.watch(model), pytest.raises(gradscope.GradientError, match="buffer 'mem' of the model") as exc:
        step(model, 1)
        step(model, 2)
    assert exc.value.findings[0].params == ("fc.bias", "fc.weight")


class CachedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.k, self.v, self.q = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, past_key_values=None):
        k, v = self.k(x), self.v(x)
        if past_key_values is not None:
            k = torch.cat([past_key_values[0][0], k], 1)
            v = torch.cat([past_key_values[0][1], v], 1)
        att = torch.softmax(self.q(x) @ k.transpose(1, 2), -1)
        return att @ v, ((k, v),)


def test_past_key_values_tuple_of_tuples_carried():
    model = CachedAttention()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    past = None
    with gradscope.watch(model):
        out, past = model(torch.randn(1, 2, 4))
        out.sum().backward()
        opt.step()
        with pytest.raises(gradscope.GradientError, match=r"input 'past_key_values' \(at past_key_values\[0\]\[0\]\)"):
            model(torch.randn(1, 2, 4), past_key_values=past)        # caught at the forward
    out, _ = model(torch.randn(1, 2, 4), past_key_values=past)
    with pytest.raises(RuntimeError, match="second time"):           # torch: it was a bug
        out.sum().backward()


def test_cache_object_holding_tensors_carried():
    from dataclasses import dataclass

    @dataclass
    class Cache:
        layers: list

    model = CachedAttention()
    with gradscope.watch(model):
        out, past = model(torch.randn(1, 2, 4))
        out.sum().backward()
        cache = Cache(layers=[past[0]])
        with pytest.raises(gradscope.GradientError, match=r"at past_key_values\.layers\[0\]\[0\]"):
            model(torch.randn(1, 2, 4), past_key_values=cache)


def test_hf_gpt2_dynamic_cache_carried():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    ids = torch.randint(0, 64, (2, 6))

    def two_steps(watched):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        opt = torch.optim.AdamW(model.parameters(), 1e-3)
        with gradscope.watch(model) if watched else torch.enable_grad():
            out = model(input_ids=ids, labels=ids, use_cache=True)
            out.loss.backward()
            opt.step()
            model(input_ids=ids, labels=ids, past_key_values=out.past_key_values).loss.backward()

    with pytest.raises(RuntimeError, match="second time"):            # torch: it was a bug
        two_steps(False)
    with pytest.raises(gradscope.GradientError, match=r"past_key_values\.layers\[0\]\.(keys|values)") as exc:
        two_steps(True)                                                # caught at the forward, before torch
    assert exc.value.findings[0].kind == "carried-graph"


def test_detector_targets_list_of_dicts_carried():
    class Detector(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 4)

        def forward(self, x, targets):
            return sum(((self.body(x) - t["boxes"]) ** 2).mean() for t in targets if "boxes" in t)

    def run(watched, first=lambda t: t):
        torch.manual_seed(0)
        det = Detector()
        opt = torch.optim.SGD(det.parameters(), lr=0.1)
        with gradscope.watch(det) if watched else torch.enable_grad():
            boxes = det.body(torch.randn(2, 4))                        # targets made by the model: the bug
            for step in range(2):
                opt.zero_grad()
                targets = [{"labels": torch.zeros(2)}, {"boxes": first(boxes) if step == 0 else boxes}]
                det(torch.randn(2, 4), targets).backward()
                opt.step()

    with pytest.raises(RuntimeError, match="second time"):             # torch: step 2 fails
        run(False)
    with pytest.raises(gradscope.GradientError, match=r"targets\[1\]\['boxes'\]") as exc:
        run(True)                                                      # step 2's forward, in the user's words
    assert "already freed" in str(exc.value) and exc.value.findings[0].params == ("body.bias", "body.weight")
    run(False, first=torch.Tensor.detach)                              # torch: no error, a stale graph is used
    with pytest.raises(gradscope.GradientError, match="was not freed") as exc:
        run(True, first=torch.Tensor.detach)                           # never backwarded before step 2
    assert "built by a forward no backward has run" in str(exc.value)
