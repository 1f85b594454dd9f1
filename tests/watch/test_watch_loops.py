"""More healthy training loops under the default ``on_error="raise"``: none may stop, warn or change a
gradient. Each runs unwatched and watched from the same seed (``tests/watch/_twins.py``): the gradients of
every step and the final weights must be bit-identical, torch's run must find every optimizer step healthy
(each held parameter that requires grad has a set, finite ``.grad``), and the watched run must warn nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import gradscope
from tests._zoo import Linears, TwoTasks
from tests.watch._twins import twin


def quiet_twin(build, step, steps=3, backwards=True, **options):
    """:func:`twin`, and no warning of any kind from either run; with ``backwards``, the guard saw some."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        guard = twin(build, step, steps=steps, **options)
    assert [str(w.message)[:200] for w in said] == []
    assert guard.counts == {} and (guard.backwards >= 1 or not backwards)
    return guard


def _mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _sgd_step(model, opt, x_shape=(3, 4)):
    opt.zero_grad()
    model(torch.randn(*x_shape)).pow(2).mean().backward()
    opt.step()


class Attention(nn.Module):
    def __init__(self, need_weights):
        super().__init__()
        self.attn, self.head = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 1)
        self.need_weights, self.weights = need_weights, None

    def forward(self, x):
        out, weights = self.attn(x, x, x, need_weights=self.need_weights)
        self.weights = None if weights is None else weights.detach()   # kept for logging, detached
        return self.head(out)


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_with_and_without_weights(need_weights):
    def build():
        model = Attention(need_weights)
        return model, torch.optim.Adam(model.parameters(), 1e-3)

    guard = quiet_twin(build, lambda m, o, i: _sgd_step(m, o, (2, 5, 8)))
    assert guard.checks == 3 and guard.truth_steps == 3


@pytest.mark.parametrize("foreach", [True, False])
def test_gradient_clipping_with_foreach(foreach):
    def build():
        model = _mlp()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, i):
        opt.zero_grad()
        (100 * model(torch.randn(3, 4))).pow(2).mean().backward()
        total = nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=foreach)
        assert total > 0.5                                            # torch: the clip did scale them
        nn.utils.clip_grad_value_(model.parameters(), 0.1, foreach=foreach)
        opt.step()

    quiet_twin(build, step)


def test_autocast_bfloat16_on_cpu_without_a_scaler():
    def build():
        model = _mlp()
        return model, torch.optim.AdamW(model.parameters(), 1e-3)

    def step(model, opt, i):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(3, 4))
        assert out.dtype == torch.bfloat16                            # torch: autocast ran the Linears in bf16
        out.float().pow(2).mean().backward()
        opt.step()

    guard = quiet_twin(build, step)
    assert guard.checks == 3


def test_param_group_added_later_for_a_new_head():
    class Grows(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk, self.heads = nn.Linear(4, 8), nn.ModuleList([nn.Linear(8, 1)])

        def forward(self, x):
            h = self.trunk(x).relu()
            return sum(head(h) for head in self.heads)

    def build():
        model = Grows()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, i):
        if i == 2:                                                    # a new head, given to the optimizer
            model.heads.append(nn.Linear(8, 1))
            opt.add_param_group({"params": list(model.heads[-1].parameters()), "lr": 0.01})
        _sgd_step(model, opt)

    quiet_twin(build, step, steps=5)


def test_two_optimizers_stepping_different_parts():
    def build():
        model = TwoTasks()
        body = [*model.trunk.parameters(), *model.task1.parameters()]
        return model, (torch.optim.SGD(body, lr=0.1), torch.optim.Adam(model.task2.parameters(), 1e-3))

    def step(model, opts, i):
        for opt in opts:
            opt.zero_grad()
        y1, y2 = model(torch.randn(3, 4))
        (y1.pow(2).mean() + y2.pow(2).mean()).backward()
        for opt in opts:
            opt.step()

    guard = quiet_twin(build, step, steps=4)
    assert guard.truth_steps == 8


def test_zero_grad_without_set_to_none():
    def build():
        model = _mlp()
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(model, opt, i):
        opt.zero_grad(set_to_none=False)
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()

    quiet_twin(build, step, steps=4)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_parameters_frozen_mid_run(set_to_none):
    def build():
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        return model, torch.optim.Adam(model.parameters(), 1e-3)

    def step(model, opt, i):
        if i == 2:
            model[0].requires_grad_(False)                            # the first layer is done training
        if i == 4:
            model[2].requires_grad_(False)
        opt.zero_grad(set_to_none=set_to_none)
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()

    quiet_twin(build, step, steps=6)


def test_backbone_unfrozen_mid_run_with_a_new_optimizer():
    def build():
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        model[0].requires_grad_(False)                                # fine-tuning: the head first
        return model, [torch.optim.SGD(model[2].parameters(), lr=0.1)]

    def step(model, holder, i):
        if i == 2:                                                    # then everything, with a new optimizer
            model[0].requires_grad_(True)
            holder[0] = torch.optim.SGD(model.parameters(), lr=0.01)
        _sgd_step(model, holder[0])

    quiet_twin(build, step, steps=5)


def test_weight_tying_and_a_shared_block_called_twice():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.block = nn.Embedding(10, 8), nn.Linear(8, 8)
            self.out = nn.Linear(8, 10, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, ids):
            return self.out(self.block(self.block(self.embed(ids)).tanh()))

    def build():
        model = Tied()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, i):
        opt.zero_grad()
        nn.functional.cross_entropy(model(torch.randint(0, 10, (6,))), torch.randint(0, 10, (6,))).backward()
        opt.step()

    quiet_twin(build, step)


def test_non_reentrant_checkpoint_and_functional_call():
    from torch.utils.checkpoint import checkpoint

    class Ckpt(Linears):
        LAYERS = {"a": (4, 8), "b": (8, 1)}

        def forward(self, x):
            return self.b(checkpoint(lambda t: self.a(t).relu(), x, use_reentrant=False))

    def build():
        model = Ckpt()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, i):
        opt.zero_grad()
        params = dict(model.named_parameters())
        out = torch.func.functional_call(model, params, (torch.randn(3, 4),)) if i % 2 else model(torch.randn(3, 4))
        out.pow(2).mean().backward()
        opt.step()

    quiet_twin(build, step, steps=4)


def _dynamo_reset():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()                                             # compile afresh: the hooks get traced
    counters.clear()
    return counters


def test_torch_compiled_module_keeps_one_graph_and_warns_nothing():
    counts = {}

    def build():
        model = _mlp()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, i):
        if i == 0:
            counts["counters"] = _dynamo_reset()
            model.compiled = [torch.compile(model, backend="aot_eager")]   # a list: not a submodule
        opt.zero_grad()
        model.compiled[0](torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        with torch.no_grad():
            model.compiled[0](torch.randn(3, 4))                      # validation: a second graph, no grad
        if i == 2:
            counts[len(counts)] = (counts["counters"]["stats"]["unique_graphs"],
                                   [k.split("\n")[0] for k in counts["counters"]["graph_break"]])

    guard = quiet_twin(build, step)
    unwatched, watched = counts[1], counts[2]
    assert unwatched == (2, [])                                       # torch: two graphs, no break
    assert watched[0] == 2                                            # the model's graphs stay whole
    assert all("torch.compiler.disable" in reason for reason in watched[1])   # only at our hooks, eagerly
    assert guard.checks == 3


def test_torch_compiled_module_forward_checks_run():
    # The forward-time checks work through a compiled forward: an evaluation without no_grad is seen.
    _dynamo_reset()
    model = _mlp()
    compiled = torch.compile(model, backend="aot_eager")
    seen = []
    with gradscope.watch(model, on_error=seen.extend):
        for _ in range(3):
            model.zero_grad()
            compiled(torch.randn(3, 4)).pow(2).mean().backward()
            model.eval()
            outs = [compiled(torch.randn(3, 4)) for _ in range(4)]    # eval forwards that keep a graph
            assert all(o.grad_fn is not None for o in outs)           # torch: each holds a graph
            model.train()
    assert [f.kind for f in seen] == ["graph-without-backward"]


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.spare = _mlp(), nn.Linear(4, 1)              # spare: never called

    def forward(self, x):
        return self.body(x)


def test_module_compiled_before_watch_keeps_the_backward_checks():
    # NOTE [torch.compile]: code compiled before watch() may run without our forward hooks; the backward's
    # checks run either way (truth: torch leaves the unused layer's .grad None).
    _dynamo_reset()
    model = Unused()
    compiled = torch.compile(model, backend="aot_eager")
    compiled(torch.randn(3, 4)).sum().backward()                     # compiled before watch()
    model.zero_grad()
    seen = []
    with gradscope.watch(model, on_error=seen.extend):
        compiled(torch.randn(3, 4)).sum().backward()
    assert model.spare.weight.grad is None and model.body[0].weight.grad is not None
    assert [(f.kind, f.params) for f in seen] == [("none-grad", ("spare.bias",)), ("none-grad", ("spare.weight",))]


def test_whole_model_saved_and_copied_while_watched(tmp_path):
    # torch.save(model) and copy.deepcopy(model) work as without gradscope (truth: the unwatched run saves
    # and copies); the saved file loads without gradscope's hooks doing anything, and a copy is not watched.
    import copy as copying
    import subprocess
    import sys

    def build():
        model = _mlp()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    loaded = []

    def step(model, opt, i):
        _sgd_step(model, opt)
        path = tmp_path / f"model{i}.pt"
        torch.save(model, path)                                      # a whole-model checkpoint
        target = copying.deepcopy(model)                                 # a target network
        with torch.no_grad():
            target(torch.randn(3, 4))
        loaded.append(torch.load(path, weights_only=False))

    guard = quiet_twin(build, step)
    assert guard.checks == 3 and len(loaded) == 6
    model, opt = build()
    with gradscope.watch(model, optimizer=opt, ratio_every=1) as ratios:
        _sgd_step(model, opt)
        torch.save(opt, tmp_path / "opt.pt")                         # the optimizer holds our step hooks
        copying.deepcopy(opt).step()
        _sgd_step(model, opt)
    assert len(ratios.update_ratios) == 2                             # the copy's step was not measured
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        copy = loaded[-1]                                             # saved while watched
        kept = [copy(torch.randn(3, 4)) for _ in range(4)]            # a live guard would warn here
        copy(torch.randn(3, 4)).sum().backward()
    assert said == [] and all(k.grad_fn is not None for k in kept)   # the copy is not watched
    code = (f"import sys, torch; sys.modules['gradscope'] = None; m = torch.load({str(tmp_path / 'model2.pt')!r}, "
            "weights_only=False); m(torch.randn(2, 4)).sum().backward(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-1500:]              # loads where gradscope is absent


def _maml_step(model, opt, i, detach=()):
    """One MAML step: fast weights from an inner gradient step, the outer loss through functional_call;
    with ``detach``, first-order MAML with those fast weights cut from their parameter (a planted bug)."""
    params = dict(model.named_parameters())
    inner = torch.func.functional_call(model, params, (torch.randn(3, 4),)).pow(2).mean()
    grads = torch.autograd.grad(inner, list(params.values()), create_graph=not detach)
    fast = {n: p - 0.1 * g for (n, p), g in zip(params.items(), grads)}
    fast.update({n: fast[n].detach() for n in detach})               # the planted bug: no path back
    opt.zero_grad()
    torch.func.functional_call(model, fast, (torch.randn(3, 4),)).pow(2).mean().backward()
    opt.step()


def test_maml_fast_weights_through_functional_call():
    def build():
        model = _mlp()
        return model, torch.optim.Adam(model.parameters(), 1e-3)

    quiet_twin(build, _maml_step, steps=3)
    torch.manual_seed(0)
    model, opt = build()
    seen = []
    with gradscope.watch(model, on_error=seen.extend):
        for i in range(2):
            _maml_step(model, opt, i)
        _maml_step(model, opt, 2, detach=("2.weight",))
    assert model[2].weight.grad is None and model[2].bias.grad is not None   # torch's truth
    assert [(f.kind, f.params) for f in seen] == [("none-grad", ("2.weight",))]


def test_per_sample_gradients_with_torch_func_assigned_to_grad():
    def build():
        model = _mlp()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, i, skip=()):
        params = {n: p.detach() for n, p in model.named_parameters()}

        def loss(p, x):
            return torch.func.functional_call(model, p, (x[None],)).pow(2).mean()

        per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, torch.randn(5, 4))
        for n, p in model.named_parameters():
            if n not in skip:
                p.grad = per_sample[n].mean(0)                        # e.g. clipped per sample, then averaged
        opt.step()

    guard = quiet_twin(build, step, backwards=False)
    assert guard.backwards == 0 and guard.truth_steps == 3            # no backward wrote .grad: none judged
    torch.manual_seed(0)
    model, opt = build()
    with gradscope.watch(model):
        for i in range(2):
            step(model, opt, i)
        stale = model[2].bias.grad
        with pytest.raises(gradscope.GradientError) as exc:
            step(model, opt, 2, skip=("2.bias",))                     # the bug: one left at last step's value
    assert model[2].bias.grad is stale                                # torch would apply it again
    assert {p for f in exc.value.findings for p in f.params} == {"2.bias"}


def test_tbptt_with_a_detached_lstm_state():
    def build():
        model = nn.LSTM(4, 8, batch_first=True)
        model.state = None                                            # (h, c) carried between chunks
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, i):
        opt.zero_grad()
        out, (h, c) = model(torch.randn(2, 5, 4), model.state)
        model.state = (h.detach(), c.detach())                        # truncated here: healthy
        out.pow(2).mean().backward()
        opt.step()

    quiet_twin(build, step, steps=4)


def test_amp_bfloat16_with_a_grad_scaler():
    def build():
        model = _mlp()
        return model, (torch.optim.SGD(model.parameters(), lr=0.01), torch.amp.GradScaler("cpu", init_scale=2.0**8))

    def step(model, opts, i):
        opt, scaler = opts
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 4)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    guard = quiet_twin(build, step, steps=4)
    assert guard.checks == 4 and guard.truth_steps == 4 and len(guard.history) == 4


def test_watching_the_compiled_wrapper_names_the_users_parameters():
    class Sometimes(Unused):
        def forward(self, x, spare=True):
            return self.body(x) + (self.spare(x) if spare else 0)

    _dynamo_reset()
    model = Sometimes()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with gradscope.watch(compiled, ignore="body.0.*") as guard:   # the names of model, not _orig_mod.*
            for _ in range(2):
                opt.zero_grad()
                compiled(torch.randn(3, 4)).sum().backward()
                opt.step()
            opt.zero_grad()
            compiled(torch.randn(3, 4), spare=False).sum().backward()    # spare left out this step
            with pytest.raises(gradscope.GradientError) as exc:
                opt.step()
    assert said == [] and "OptimizedModule" not in repr(guard) and "Sometimes" in repr(guard)
    assert model.spare.weight.grad is None                           # torch's truth
    assert {p for f in exc.value.findings for p in f.params} == {"spare.weight", "spare.bias"}


def test_a_layer_unfrozen_later_is_judged_at_that_step():
    model = Unused()
    model.spare.requires_grad_(False)                                 # frozen at watch(): not hooked
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    raised = []
    with gradscope.watch(model):
        for step in range(4):
            if step == 2:
                model.spare.requires_grad_(True)                      # the schedule unfreezes it, unused
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            try:
                opt.step()
            except gradscope.GradientError as exc:
                raised.append((step, sorted(p for f in exc.findings for p in f.params)))
                assert model.spare.weight.grad is None                # torch's truth at that step
    assert raised[0] == (2, ["spare.bias", "spare.weight"])
