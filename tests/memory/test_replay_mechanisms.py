"""Replay mechanisms checked one by one on small programs against torch.profiler (tests/_memtruth.py):
the input batch in the absolute peak, pass-through nodes, non-reentrant checkpoint recompute and levels."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn as nn

import gradscope
from tests._memtruth import measure

warnings.filterwarnings("ignore", message=".*use_reentrant.*")


@pytest.fixture(autouse=True, scope="module")
def _cache_dir(tmp_path_factory):
    old = os.environ.get("GRADSCOPE_CACHE")
    os.environ["GRADSCOPE_CACHE"] = str(tmp_path_factory.mktemp("gs-cache"))
    yield
    if old is None:
        os.environ.pop("GRADSCOPE_CACHE", None)
    else:
        os.environ["GRADSCOPE_CACHE"] = old


def _truth(forward, model, batch, retain_graph=False, **kw):
    """Warm the workspace cache, then measure ``forward()`` with the prediction taken inside the run."""
    gradscope.inspect(forward(), model=model).backward_memory(retain_graph=retain_graph, **kw)
    return measure(lambda: (forward(), model), before=batch, retain_graph=retain_graph,
                   inspect=lambda loss, m: gradscope.inspect(loss, model=m),
                   predict=lambda r, _: r.backward_memory(retain_graph=retain_graph, **kw))


@pytest.mark.parametrize("first", ["saved", "not-saved"])
def test_absolute_peak_counts_the_batch_once(first):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    x = torch.randn(32, 64)
    op = (lambda t: t) if first == "saved" else (lambda t: t * 1.0)  # x * 1.0 saves nothing
    without = gradscope.inspect(m(op(x)).sum(), model=m).backward_memory()  # before any .grad exists
    truth = _truth(lambda: m(op(x)).sum(), m, [x], inputs=[x])
    assert truth.prediction.absolute_peak == truth.absolute_peak
    assert truth.prediction.absolute_peak - without.absolute_peak == (0 if first == "saved" else x.nbytes)


def test_batch_that_requires_grad_is_counted_once():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    x = torch.randn(32, 64, requires_grad=True)
    target = torch.randn(32, 64)
    truth = _truth(lambda: ((m(x * 2.0) - target) ** 2).sum(), m, [x, target], inputs={"x": x, "y": [target]})
    assert abs(truth.prediction.absolute_peak - truth.absolute_peak) <= 64  # 8 B: a wrapped scalar
    assert truth.prediction.parts["leaf inputs"] == x.nbytes + target.nbytes  # x is a leaf too: once
