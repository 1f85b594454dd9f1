"""Healthy training loops that ``watch(on_error="raise")`` must never stop nor change: each runs several
steps unwatched and watched from the same seed (``tests/watch/_twins.py``) and the gradients and weights
must be bit-identical; the truth of "healthy" is torch's own run (every held parameter has a finite
``.grad`` at each ``opt.step()``)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from tests.watch._twins import twin


def _sgd(model, lr=0.01):
    return torch.optim.SGD(model.parameters(), lr=lr)


def _mse_step(model, opt, x_shape, dtype=torch.float32):
    opt.zero_grad()
    loss = model(torch.randn(*x_shape).to(dtype)).float().pow(2).mean()
    loss.backward()
    opt.step()


def test_float64_model():
    def build():
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
        return model, _sgd(model)

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
        def build(dtype=dtype):
            model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).to(dtype)
            return model, _sgd(model)

        guard = twin(build, lambda m, o, i, dtype=dtype: _mse_step(m, o, (3, 4), dtype))
        assert guard.counts == {} and guard.checks == 3


def test_sparse_embedding_gradients():
    def build():
        model = nn.Sequential(nn.Embedding(20, 4, sparse=True), nn.Linear(4, 1))
        return model, _sgd(model)

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
    def build():
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        return model, _sgd(model)

    def step(model, opt, i):
        if i == 1:
            model.to(torch.float64)                                  # after watch(), mid-run
        _mse_step(model, opt, (3, 4), torch.float64 if i >= 1 else torch.float32)

    guard = twin(build, step, steps=4)
    assert guard.counts == {} and guard.checks == 4


def test_siamese_with_a_detached_branch_is_not_stopped():
    def build():
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        return model, _sgd(model)

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
