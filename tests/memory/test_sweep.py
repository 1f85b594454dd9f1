"""Real-world sweep: architectures none of us wrote, predictions vs what backward() does.

For each model (tiny config, random weights, no download): the parameters gradscope says get no gradient
are exactly those torch leaves with ``.grad is None`` (a pooler unused by the loss included), there is no
other error finding (no false positive), and ``saved_bytes`` equals the unique storages that
``saved_tensors_hooks`` see. ``python bench/sweep.py`` writes the table of the same runs to
``bench/sweep.md``. The ``transformers`` cases skip when it is not installed (a test-only extra).
"""

from __future__ import annotations

import pytest

from tests._sweep import measure
from tests._sweep_models import HF_CASES, TORCH_CASES, have_transformers


def _check(build):
    r = measure(build)
    assert r["predicted_none"] == r["truth_none"], (r["predicted_none"], r["truth_none"])
    assert not r["maybe_none"]
    assert not r["other_errors"], [f.message for f in r["other_errors"]]
    if r["hidden"]:
        assert r["saved_bytes"] <= r["packed_bytes"]
    else:
        assert r["saved_bytes"] == r["packed_bytes"]
    return r


@pytest.mark.parametrize("name", sorted(TORCH_CASES))
def test_torch_architectures(name):
    r = _check(TORCH_CASES[name])
    if "unused head" in name:
        assert r["truth_none"] == {"aux.weight", "aux.bias"}


@pytest.mark.skipif(not have_transformers(), reason="transformers is not installed (test-only extra)")
@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_transformers_architectures(name):
    r = _check(HF_CASES[name])
    if "loss on hidden states" in name:   # the pooler is legitimately unused: predicted exactly
        assert r["truth_none"] == {"pooler.dense.weight", "pooler.dense.bias"}
