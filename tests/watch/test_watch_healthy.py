"""Healthy training loops that ``watch(on_error="raise")`` must never stop nor change: each runs several
steps unwatched and watched from the same seed (``tests/watch/_twins.py``) and the gradients and weights
must be bit-identical; the truth of "healthy" is torch's own run (every held parameter has a finite
``.grad`` at each ``opt.step()``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tests._zoo import TwoTasks
from tests.watch._twins import snapshot, twin


def _sgd(model, lr=0.01):
    return torch.optim.SGD(model.parameters(), lr=lr)


def _with_sgd(make):
    """A ``build`` for :func:`twin`: the model ``make()`` returns, with plain SGD."""

    def build():
        model = make()
        return model, _sgd(model)

    return build


def _mse_step(model, opt, x_shape, dtype=torch.float32):
    opt.zero_grad()
    loss = model(torch.randn(*x_shape).to(dtype)).float().pow(2).mean()
    loss.backward()
    opt.step()


def test_float64_model():
    build = _with_sgd(lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double())

    guard = twin(build, lambda m, o, i: _mse_step(m, o, (3, 4), torch.float64))
    assert guard.counts == {} and guard.checks == 3 and len(guard.history) == 3


class Spectral(nn.Module):
    """A Fourier-neural-operator layer: complex spectral weights on the low modes, plus a pointwise Linear."""

    def __init__(self, channels=4, modes=5):
        super().__init__()
        self.w = nn.Parameter(0.1 * torch.randn(channels, channels, modes, dtype=torch.cfloat))
        self.pointwise = nn.Linear(channels, channels)

    def forward(self, x):  # (batch, channels, n)
        xf = torch.fft.rfft(x)
        yf = torch.einsum("bin,ion->bon", xf[..., : self.w.shape[-1]], self.w)
        y = torch.fft.irfft(yf, n=x.shape[-1])
        return y + self.pointwise(x.transpose(1, 2)).transpose(1, 2)


def test_complex_spectral_weights():
    def build():
        model = Spectral()
        return model, torch.optim.Adam(model.parameters(), 1e-3)

    guard = twin(build, lambda m, o, i: _mse_step(m, o, (2, 4, 8)))
    assert guard.counts == {} and guard.checks == 3
    assert all(v > 0 for v in guard.history[-1].values())          # the complex gradient's norm is real


def test_half_and_bfloat16_models():
    for dtype in (torch.float16, torch.bfloat16):
        build = _with_sgd(lambda dtype=dtype: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).to(dtype))

        guard = twin(build, lambda m, o, i, dtype=dtype: _mse_step(m, o, (3, 4), dtype))
        assert guard.counts == {} and guard.checks == 3


def test_sparse_embedding_gradients():
    build = _with_sgd(lambda: nn.Sequential(nn.Embedding(20, 4, sparse=True), nn.Linear(4, 1)))

    def step(model, opt, i):
        opt.zero_grad()
        model(torch.randint(0, 20, (6,))).pow(2).mean().backward()
        assert model[0].weight.grad.is_sparse                        # torch: a sparse gradient
        opt.step()

    guard = twin(build, step)
    assert guard.counts == {} and guard.checks == 3


def test_lazy_module_hooked_once_materialized():
    def build():
        model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 1))
        model(torch.randn(1, 5))                                     # the usual dry run before the optimizer
        return model, _sgd(model)

    guard = twin(build, lambda m, o, i: _mse_step(m, o, (3, 5)))
    assert guard.counts == {} and guard.checks == 3


def test_lazy_module_materialized_inside_the_watched_loop():
    def build():
        return nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 1)), None

    def step(model, _opt, i):
        model.zero_grad()
        model(torch.randn(3, 5)).pow(2).mean().backward()

    guard = twin(build, step)
    assert guard.counts == {} and guard.checks == 3


def test_model_converted_to_float64_after_watch():
    build = _with_sgd(lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))

    def step(model, opt, i):
        if i == 1:
            model.to(torch.float64)                                  # after watch(), mid-run
        _mse_step(model, opt, (3, 4), torch.float64 if i >= 1 else torch.float32)

    guard = twin(build, step, steps=4)
    assert guard.counts == {} and guard.checks == 4


def test_siamese_with_a_detached_branch_is_not_stopped():
    build = _with_sgd(lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)))

    def step(model, opt, i):
        opt.zero_grad()
        online = model(torch.randn(3, 4))
        target = model(torch.randn(3, 4)).detach()                  # the target branch: no gradient
        (online - target).pow(2).mean().backward()
        opt.step()

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        guard = twin(build, step, steps=4)
    texts = [str(w.message) for w in said]
    assert set(guard.counts) == {"graph-without-backward"}         # a warning, never raised
    assert len([t for t in texts if "graph-without-backward" in t]) == 1       # said once


class GAN(nn.Module):
    """Generator and discriminator in one module, as Lightning holds them."""

    def __init__(self):
        super().__init__()
        self.G = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        self.D = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def test_gan_in_one_module_with_two_optimizers():
    bce = nn.BCEWithLogitsLoss()

    def build():
        model = GAN()
        return model, (torch.optim.Adam(model.G.parameters(), 1e-3), torch.optim.Adam(model.D.parameters(), 1e-3))

    def step(model, opts, i):
        opt_g, opt_d = opts
        fake = model.G(torch.randn(8, 4))
        opt_d.zero_grad()
        real = torch.randn(8, 4)
        before = snapshot(model.G)
        (bce(model.D(real), torch.ones(8, 1)) + bce(model.D(fake.detach()), torch.zeros(8, 1))).backward()
        assert all(a is b or torch.equal(a, b) for a, b in zip(before, snapshot(model.G)))  # torch: G got nothing
        opt_d.step()
        opt_g.zero_grad()
        bce(model.D(fake), torch.ones(8, 1)).backward()
        opt_g.step()

    guard = twin(build, step, steps=4)
    assert guard.counts == {} and guard.backwards == 8


def test_multi_task_two_backwards_per_step():
    build = _with_sgd(TwoTasks)

    def step(model, opt, i):
        opt.zero_grad()
        y1, y2 = model(torch.randn(4, 4))
        y1.pow(2).mean().backward(retain_graph=True)                   # task2 gets nothing from this one
        assert model.task2.weight.grad is None or not model.task2.weight.grad.any()
        y2.pow(2).mean().backward()
        opt.step()

    guard = twin(build, step)
    assert guard.counts == {} and guard.backwards == 6


def test_accumulation_over_micro_batches_without_accumulate():
    build = _with_sgd(TwoTasks)

    def step(model, opt, i):
        opt.zero_grad()
        for task in (0, 1):                                            # each micro-batch trains one task
            model(torch.randn(4, 4))[task].pow(2).mean().backward()
        opt.step()

    guard = twin(build, step)
    assert guard.counts == {}


def test_lbfgs_step_with_a_closure():
    def build():
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        return model, torch.optim.LBFGS(model.parameters(), max_iter=3)

    x = torch.randn(6, 4)

    def step(model, opt, i):
        def closure():
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        opt.step(closure)

    guard = twin(build, step)
    assert guard.counts == {} and guard.backwards >= 3


def test_hf_gpt2_with_clipping():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)

    def build():
        model = transformers.GPT2LMHeadModel(config)
        return model, torch.optim.AdamW(model.parameters(), 1e-3)

    def step(model, opt, i):
        opt.zero_grad()
        ids = torch.randint(0, 64, (2, 12))
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    guard = twin(build, step)
    assert guard.counts == {}


def test_stateful_lstm_done_right():
    from tests.watch.test_watch_bugs import StatefulLSTM

    build = _with_sgd(lambda: StatefulLSTM(detach=True))

    guard = twin(build, lambda m, o, i: _mse_step(m, o, (2, 3)), steps=4)
    assert guard.counts == {}


def test_logging_attribute_that_no_backward_uses():
    class Logs(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)
            self.last = None

        def forward(self, x):
            out = self.fc(x)
            self.last = out                                            # kept for logging, never used again
            return out

    build = _with_sgd(Logs)

    guard = twin(build, lambda m, o, i: _mse_step(m, o, (3, 4)), steps=4)
    assert guard.counts == {}
