"""``gradscope.watch``: ground truth from torch (which ``.grad`` changed, which values are finite)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradscope
from tests._zoo import Linears
from tests.watch import _ddp as _watch_ddp


class TwoHeads(Linears):
    """A trunk and two heads; ``forward(x, head)`` uses only the named head."""

    LAYERS = {"trunk": (4, 8), "a": (8, 1), "b": (8, 1)}

    def forward(self, x, head="both"):
        h = self.trunk(x).relu()
        if head == "both":
            return self.a(h) + self.b(h)
        return getattr(self, head)(h)


def versions(model):
    """Ground truth for 'received a gradient in this backward': the .grad's version counter (or None)."""
    return {n: (None if p.grad is None else (id(p.grad), p.grad._version))
            for n, p in model.named_parameters()}


def changed(before, after):
    return {n for n in after if after[n] is not None and after[n] != before[n]}


def hook_keys(model):
    return {n: (list((p._backward_hooks or {}).keys()), list((p._post_accumulate_grad_hooks or {}).keys()))
            for n, p in model.named_parameters()}


def flagged(exc_info, kind):
    return {p for f in exc_info.value.findings if f.kind == kind for p in f.params}


X = torch.randn(5, 4)


def test_custom_function_returning_none_for_weight():
    class NoWeightGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, grad):
            (w,) = ctx.saved_tensors
            return grad @ w, None                   # the weight's gradient is dropped

    class Net(Linears):
        LAYERS = {"inp": (4, 4), "proj": (4, 3)}

        def forward(self, x):
            return NoWeightGrad.apply(self.inp(x), self.proj.weight) + self.proj.bias

    model = Net()
    with gradscope.watch(model):
        with pytest.raises(gradscope.GradientError, match=r"proj\.weight \(module 'proj', Linear\)") as exc:
            model(X).sum().backward()
    assert type(exc.value) is gradscope.GradientError and isinstance(exc.value, RuntimeError)
    truth = {n for n, p in model.named_parameters() if p.grad is None}
    assert truth == {"proj.weight"} == flagged(exc, "none-grad")
    f = exc.value.findings[0]
    assert (f.kind, f.severity, f.params) == ("none-grad", "error", ("proj.weight",))
    assert "gradscope.inspect(loss, model=model, trace=tr)" in f.message and "autograd.Function" in f.message


def test_branch_skipped_on_step_2_with_stale_grad():
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradscope.watch(model) as guard:
        model(X).sum().backward()                   # step 1: everything used
        opt.step()
        opt.zero_grad(set_to_none=False)            # .grad kept as zeros: stale, not None
        before = versions(model)
        model(X, head="a").sum().backward()         # step 2: head b skipped; judged at the step
        after = versions(model)
        weight = model.b.weight.detach().clone()
        with pytest.raises(gradscope.GradientError) as exc:
            opt.step()                              # SGD holds b, which got nothing since its last step
    truth = set(after) - changed(before, after)
    assert truth == {"b.weight", "b.bias"} == flagged(exc, "none-grad")
    assert all(p.grad is not None for p in model.parameters())      # stale grads did not hide it
    assert torch.equal(model.b.weight, weight)                       # raised before the update
    assert "since the previous step of SGD (checked at its step 2)" in str(exc.value)
    assert "2 of them still hold a .grad from an earlier step" in str(exc.value)
    assert guard.checks == 2


def test_sqrt_of_zero_gives_nonfinite_gradient():
    model = TwoHeads()
    with gradscope.watch(model):
        with pytest.raises(gradscope.GradientError, match="NaN or Inf") as exc:
            (model(X).sum() + (model.a.weight * 0).sqrt().sum()).backward()
    truth = {n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()}
    assert truth == {"a.weight"} == flagged(exc, "nonfinite-grad")
    assert "8 Inf of 8 values" in str(exc.value) or "8 NaN of 8 values" in str(exc.value)
    assert "set_detect_anomaly" in exc.value.findings[0].message


def test_check_nonfinite_off():
    model = TwoHeads()
    with gradscope.watch(model, check_nonfinite=False) as guard:
        (model(X).sum() + model.a.weight.mul(0).sqrt().sum()).backward()
    assert not torch.isfinite(model.a.weight.grad).all() and guard.checks == 1


def test_healthy_training_raises_nothing():
    model = TwoHeads()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradscope.watch(model) as guard:
        for _ in range(6):
            opt.zero_grad()
            nn.functional.mse_loss(model(X), torch.ones(5, 1)).backward()
            opt.step()
    assert guard.checks == 6 and guard.findings == () and all(p.grad is not None for p in model.parameters())


def test_remove_and_context_exit_leave_no_hook():
    model = TwoHeads()
    before = hook_keys(model)
    guard = gradscope.watch(model)
    assert hook_keys(model) != before
    guard.remove()
    guard.remove()                                  # idempotent
    assert hook_keys(model) == before
    model(X, head="a").sum().backward()             # would raise if a hook or callback were left
    with gradscope.watch(model) as guard:
        assert "active" in repr(guard)
    assert hook_keys(model) == before and "removed" in repr(guard)
    model(X, head="a").sum().backward()


def test_no_callback_after_remove_mid_backward():
    model = TwoHeads()
    seen = []
    guard = gradscope.watch(model, on_error=seen.append)
    # our callback is queued by the first hook; remove() runs before the engine reaches the callback
    handle = model.trunk.weight.register_post_accumulate_grad_hook(lambda p: guard.remove())
    model(X, head="a").sum().backward()
    handle.remove()
    assert seen == [] and guard.checks == 0


def test_on_error_warn_and_callable():
    model = TwoHeads()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with gradscope.watch(model, on_error="warn"):
            model(X, head="a").sum().backward()
    assert [w.category for w in record] == [RuntimeWarning, RuntimeWarning]
    assert "b.weight" in str(record[0].message) and "summary over 1 backwards" in str(record[1].message)
    assert record[0].filename == __file__          # points at the user's backward() line
    seen = []
    with gradscope.watch(model, on_error=seen.append):
        model(X, head="b").sum().backward()
    assert [{p for f in fs for p in f.params} for fs in seen] == [{"a.weight", "a.bias"}]


def test_ignore_every_and_frozen():
    model = TwoHeads()
    with gradscope.watch(model, ignore=["b.*"]) as guard:
        model(X, head="a").sum().backward()
    assert guard.checks == 1
    model.b.requires_grad_(False)                   # frozen: never flagged
    with gradscope.watch(model):
        model(X, head="a").sum().backward()
    model.b.requires_grad_(True)
    with gradscope.watch(model) as guard:
        model.b.requires_grad_(False)               # frozen after watch() started: not flagged either
        model(X, head="a").sum().backward()
    model.b.requires_grad_(True)
    raised = []
    with gradscope.watch(model, every=2) as guard:
        for _ in range(4):
            try:
                model(X, head="a").sum().backward()
                raised.append(False)
            except gradscope.GradientError:
                raised.append(True)
    assert raised == [True, False, True, False] and guard.backwards == 4
    with pytest.raises(gradscope.InputValueError, match="'hed.*' matches no parameter"):
        gradscope.watch(model, ignore="hed.*")
    with pytest.raises(gradscope.InputValueError, match="on_error"):
        gradscope.watch(model, on_error="ignore")
    with pytest.raises(gradscope.InputTypeError):
        gradscope.watch(model.trunk.weight)


def test_other_backwards_are_not_checked():
    model, other = TwoHeads(), nn.Linear(4, 1)
    with gradscope.watch(model) as guard:
        other(X).sum().backward()                   # another model's loss
        torch.autograd.grad(model(X, head="a").sum(), list(model.trunk.parameters()))   # no .grad written
    assert guard.backwards == 0


def test_reentrant_checkpoint_no_false_alarm():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1))
    with gradscope.watch(model) as guard:
        h = model[0](X.requires_grad_(False))
        h = checkpoint(model[1], h, use_reentrant=True)   # a nested backward inside the outer one
        model[2](h).sum().backward()
        assert all(p.grad is not None for p in model.parameters()) and guard.backwards == 1
        model.zero_grad()
        h = model[1](model[0](X))                   # the nested backward ends before model[0:2] get grads
        checkpoint(model[2], h, use_reentrant=True).sum().backward()
    assert all(p.grad is not None for p in model.parameters()) and guard.backwards == 2


def test_backward_that_raised_half_way_leaves_no_stamp():
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise ValueError("boom")

    model = TwoHeads()
    with gradscope.watch(model):
        with pytest.raises(ValueError, match="boom"):   # head b's hook fires, then the backward dies
            model.b(Boom.apply(model.trunk(X))).sum().backward()
        model.zero_grad(set_to_none=False)
        with pytest.raises(gradscope.GradientError) as exc:
            model(X, head="a").sum().backward()
    assert flagged(exc, "none-grad") == {"b.weight", "b.bias"}


def test_accumulation_window():
    model = TwoHeads()
    with gradscope.watch(model, accumulate=2) as guard:
        model(X, head="a").sum().backward()         # micro-batch 1 uses a, micro-batch 2 uses b
        model(X, head="b").sum().backward()
        assert guard.checks == 1
        model(X, head="a").sum().backward()
        before = versions(model)
        with pytest.raises(gradscope.GradientError, match="accumulation window of 2 backwards") as exc:
            model(X, head="a").sum().backward()
        assert changed(before, versions(model)) == {"trunk.weight", "trunk.bias", "a.weight", "a.bias"}
    assert flagged(exc, "none-grad") == {"b.weight", "b.bias"}
    with gradscope.watch(model):                   # per-backward semantics: micro-batch 1 alone is checked
        with pytest.raises(gradscope.GradientError):
            model(X, head="a").sum().backward()


def test_amp_scaler_skipped_step_is_expected():
    model = TwoHeads()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)   # overflows the fp32 gradients
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weight = model.a.weight.detach().clone()
    with gradscope.watch(model, scaler=scaler) as guard:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(X).float().pow(2).sum() * 100
        scaler.scale(loss).backward()
        grads_finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
        scaler.step(opt)
        scaler.update()
    assert not grads_finite                                        # torch: the gradients were Inf
    assert torch.equal(model.a.weight, weight) and scaler.get_scale() == 2.0 ** 126   # step skipped
    assert guard.skipped_by_scaler == 1 and guard.findings == ()
    opt.zero_grad()
    with gradscope.watch(model), pytest.raises(gradscope.GradientError, match="NaN or Inf"):
        scaler.scale(model(X).pow(2).sum() * 100).backward()       # without scaler=: reported


def test_amp_scaler_persistent_nan_is_reported():
    model = TwoHeads()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradscope.watch(model, scaler=scaler):
        with pytest.raises(gradscope.GradientError, match="scale is already down to 0.5") as exc:
            for _ in range(5):
                opt.zero_grad()
                loss = model(X).sum() + model.a.weight.mul(0).sqrt().sum()    # NaN whatever the scale
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    assert scaler.get_scale() == 0.5 and flagged(exc, "nonfinite-grad") == {"a.weight"}


def test_data_parallel_is_unwrapped():
    model = TwoHeads()
    with gradscope.watch(nn.DataParallel(model)) as guard:
        with pytest.raises(gradscope.GradientError) as exc:
            nn.DataParallel(model)(X, head="a").sum().backward()
    assert flagged(exc, "none-grad") == {"b.weight", "b.bias"} and "module." not in str(exc.value)
    assert "TwoHeads" in repr(guard)


def test_repr_and_guard_counts():
    model = TwoHeads()
    guard = gradscope.watch(model, every=3, ignore=["b.*"])
    text = repr(guard)
    assert text.startswith("<gradscope.watch TwoHeads: 4 parameters") and "every=3" in text
    assert "ignore=['b.*']" in text and "active" in text
    guard.remove()


def test_ddp_gloo_unused_head_named_before_ddp_error_and_nan_on_one_rank(tmp_path):
    import torch._dynamo  # noqa: F401  (DDP's constructor imports it: once here, not in both forked children)
    port = _watch_ddp.free_port()
    mp.start_processes(_watch_ddp.worker, args=(port, str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")       # spawn would re-import torch in both children
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["healthy_checks"] == 3 and out["healthy_none"] == []        # no false alarm under DDP
        step0 = out["step0"]
        assert step0["type"] == "GradientError" and step0["kinds"] == ["none-grad"]
        assert step0["params"] == ["head.bias", "head.weight"] == out["none_after_step0"]   # torch agrees
        assert f"rank {rank} of 2" in step0["message"] and "module." not in step0["message"]
        assert "find_unused_parameters=True" in step0["message"]
        assert "Expected to have finished reduction" in out["step1"]   # DDP's own, later, unnamed error
        assert out["nan"] == out["nan_truth"] == ["body.weight"]         # checked after DDP's all-reduce


def test_ignore_as_one_string_is_one_pattern():
    # A string is one name or pattern, never its characters: "0.weight" ignores that parameter only.
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    model[0].weight.requires_grad_(True)
    seen = []
    with gradscope.watch(model, ignore="0.weight", on_error=seen.extend) as guard:
        (model[1](model[0].bias.expand(4, 2))).sum().backward()       # 0.weight unused: ignored
    assert model[0].weight.grad is None and model[0].bias.grad is not None   # torch's truth
    assert seen == [] and guard.checks == 1 and "ignore=['0.weight']" in repr(guard)
    with gradscope.watch(model, ignore="0.bias", on_error=seen.extend):
        (model[1](model[0].bias.expand(4, 2))).sum().backward()
    assert [f.params for f in seen] == [("0.weight",)]               # the string named 0.bias only
