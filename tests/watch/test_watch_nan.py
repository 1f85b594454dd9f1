"""Where a NaN/Inf gradient was born: the op ``watch`` names must be the one anomaly mode reports."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import gradscope


class Net(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)

    def forward(self, x):
        h = self.a(x)
        z = h * 0
        if self.kind == "sqrt":
            h = z.sqrt()                                             # op: sqrt
        elif self.kind == "log":
            h = z.log().clamp_min(-10)                               # op: log
        elif self.kind == "where":
            h = torch.where(z > 0, z.sqrt(), z)                      # op: where
        elif self.kind == "zero-norm":
            h = h * z.pow(2).sum(-1, keepdim=True).sqrt()            # op: zero-norm
        elif self.kind == "float16":
            h = (h.half() * 2).float() * 1e5                         # op: float16
        return self.b(h)


def _line(marker):
    with open(__file__, encoding="utf-8") as f:
        for i, text in enumerate(f, 1):
            if text.rstrip().endswith(marker):
                return f"test_watch_nan.py:{i}"
    raise AssertionError(marker)


def anomaly_op(model, x) -> str:
    """Truth: the op torch.autograd.detect_anomaly() names ("Function 'X' returned nan values")."""
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.detect_anomaly():
            with pytest.raises(RuntimeError) as exc:
                model(x).sum().backward()
    return re.search(r"Function '(\w+)' returned nan", str(exc.value)).group(1)


CASES = {          # kind -> (op where the first non-finite value is born, words of the likely cause)
    "sqrt": ("SqrtBackward0", "sqrt at 0"),
    "log": ("LogBackward0", "log at 0"),
    "where": ("SqrtBackward0", "torch.where trap"),
    "zero-norm": ("SqrtBackward0", "norm sqrt(sum(x**2)) of a zero vector"),
    "float16": ("MulBackward0", "overflow in float16"),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_nan_origin_matches_anomaly_mode(kind):
    torch.manual_seed(0)
    model, x = Net(kind), torch.randn(2, 4)
    seen = []
    original = torch.autograd._engine_run_backward
    with gradscope.watch(model, on_error=seen.append) as guard:
        model(x).sum().backward()                  # step 1: found, origin not known yet: arms
        assert torch.autograd._engine_run_backward is not original     # armed for one backward
        model.zero_grad()
        model(x).sum().backward()                  # step 2: instrumented
        assert torch.autograd._engine_run_backward is original
        assert not torch.is_anomaly_enabled()
    bad = {n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()}    # torch's truth
    first, second = seen
    assert all(f.kind == "nonfinite-grad" for f in first + second)
    assert "armed per-node checks" in first[0].message and first[0].location is None
    truth = anomaly_op(model, x)
    born, cause = CASES[kind]
    msg = second[0].message
    assert f"born in the backward op {born}" in msg and cause in msg
    if truth == born:
        assert "first became NaN" not in msg
    else:
        assert f"first became NaN in {truth}, the op torch.autograd.detect_anomaly() names" in msg
    assert second[0].location == _line(f"# op: {kind}")
    assert "the watched model's own forward" in msg
    assert {p for f in second for p in f.params} == bad
    assert guard.counts == {"nonfinite-grad": len(first) + len(second)}


def test_origin_inside_a_submodule_and_healthy_step_disarms():
    class Bad(nn.Module):
        def forward(self, x):
            return (x * 0).sqrt()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Bad(), nn.Linear(4, 1))
    seen = []
    original = torch.autograd._engine_run_backward
    with gradscope.watch(model, on_error=seen.append):
        for _ in range(2):
            model.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
        assert "in module '1'" in seen[1][0].message
        model[1].forward = lambda x: x                 # fixed: the next step is healthy
        model.zero_grad()
        model(torch.randn(2, 4)).sum().backward()        # armed after step 2: runs instrumented, healthy
        assert len(seen) == 2 and torch.autograd._engine_run_backward is original
        assert not torch.is_anomaly_enabled()
        from torch.nn.modules import module as nn_module
        assert not nn_module._global_forward_pre_hooks and not nn_module._global_forward_hooks


def test_nan_in_the_loss_is_born_in_the_forward():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    seen = []
    with gradscope.watch(model, on_error=seen.append):
        for _ in range(2):
            model.zero_grad()
            out = model(torch.randn(2, 4))
            (out * float("nan")).sum().backward()
    assert "born in the forward, before backward" in seen[1][0].message


def test_raise_mode_says_how_to_get_the_origin_and_scaler_does_not_arm():
    model = Net("sqrt")
    x = torch.randn(2, 4)
    with gradscope.watch(model) as guard:
        with pytest.raises(gradscope.GradientError, match="catch this error and run one more step"):
            model(x).sum().backward()
        model.zero_grad()
        with pytest.raises(gradscope.GradientError, match="born in the backward op SqrtBackward0"):
            model(x).sum().backward()
    assert guard.counts["nonfinite-grad"] >= 2
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)
    healthy = nn.Linear(4, 1)
    original = torch.autograd._engine_run_backward
    with gradscope.watch(healthy, scaler=scaler):
        scaler.scale(healthy(x).pow(2).sum() * 100).backward()        # Inf from loss scaling: expected
        assert torch.autograd._engine_run_backward is original        # not armed


def test_nan_applied_by_the_update_is_said_once_and_points_back():
    torch.manual_seed(0)
    model = Net("sqrt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with gradscope.watch(model, on_error="warn") as guard:
            for _ in range(4):                                       # the loop goes on after the NaN
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
    assert torch.isnan(model.a.weight).all()                          # torch: the update wrote NaN
    texts = [str(w.message) for w in said if "summary" not in str(w.message)]
    assert guard.counts.get("nonfinite-param") == 1
    (poison,) = [t for t in texts if "nonfinite-param" in t]
    assert "a.weight" in poison and "gradients of backward 1 (the first non-finite step)" in poison
    assert not any("born in the forward" in t for t in texts)          # not the misleading "check the inputs"
    assert sum("gradients hold NaN or Inf" in t for t in texts) == 1    # the NaN gradients: said once


def test_nan_origin_from_an_earlier_step_is_named_after_the_update():
    torch.manual_seed(0)
    model = Net("sqrt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    truth = anomaly_op(Net("sqrt"), x)
    seen = []
    with gradscope.watch(model, on_error=seen.append):
        for step in range(1, 4):
            opt.zero_grad()
            model(x).sum().backward()
            if step >= 2:                                            # no update on step 1 (a warm-up)
                opt.step()
    kinds = [[f.kind for f in fs] for fs in seen]
    assert kinds[0] == ["nonfinite-grad"] * 2 and kinds[1] == ["nonfinite-grad"] * 2   # a.weight, a.bias
    assert kinds[2] == ["nonfinite-param"]                            # step 3: once, not per parameter
    (poison,) = seen[2]
    assert "At backward 2: The first non-finite value was born in the backward op SqrtBackward0" in poison.message
    assert f"it first became NaN in {truth}, the op torch.autograd.detect_anomaly() names" in poison.message
    assert poison.location == _line("# op: sqrt")


def test_two_nan_losses_in_a_row_keep_the_op_anomaly_mode_names():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x = torch.randn(2, 4)

    class NanLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return self.inner(x) * float("nan")

    truth = anomaly_op(NanLoss(), x)
    seen = []
    with gradscope.watch(model, on_error=seen.append):
        for _ in range(2):
            model.zero_grad()
            (model(x) * float("nan")).sum().backward()
    assert "born in the forward" in seen[1][0].message
    assert f"detect_anomaly() would name {truth}" in seen[1][0].message
