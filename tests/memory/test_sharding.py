"""Per-rank DDP / FSDP2 memory predicted from one process, against real gloo runs measured per rank with
torch.profiler (``tests/_shardtruth.py``)."""

from __future__ import annotations

import pytest
import torch

import gradscope
from gradscope.errors import InputTypeError, InputValueError
from tests._shardmodels import batch, build, loss_of
from tests._shardtruth import measure

DDP_CONFIGS = {
    "ddp": ({"kind": "ddp"}, gradscope.DDP(2)),
    "ddp-view": ({"kind": "ddp", "bucket_view": True}, gradscope.DDP(2, gradient_as_bucket_view=True)),
    "ddp-no-opt": ({"kind": "ddp", "opt": False}, gradscope.DDP(2)),
    "ddp-view-no-opt": (
        {"kind": "ddp", "bucket_view": True, "opt": False},
        gradscope.DDP(2, gradient_as_bucket_view=True),
    ),
}


def predict(model_name: str, spec, n: int = 8, opt: bool = True, **kw):
    model = build(model_name)
    optimizer = torch.optim.AdamW(model.parameters()) if opt else None
    x = batch(model_name, n)  # held, as the rank holds its batch
    with gradscope.trace(model) as tr:
        loss = loss_of(model(x))
    report = gradscope.inspect(loss, model=model, trace=tr)
    return report.what_if(optimizer=optimizer, shard=spec, **kw)


FAST = ["ddp", "ddp-view"]
FSDP_FAST = {"fsdp": {"kind": "fsdp"}}


@pytest.fixture(scope="module")
def fast_truth():
    """The fast subset, measured in one process group: DDP default and bucket view, FSDP2 fp32 reshard True."""
    cfgs = [DDP_CONFIGS[n][0] for n in FAST] + list(FSDP_FAST.values())
    return dict(zip(FAST + list(FSDP_FAST), measure("mlp", cfgs, world=2, runs=3)))


def check_range(wi, runs, what):
    """Every rank: the floor within 1% of its lowest run, every run at or below the ceiling."""
    for r, (low, high) in enumerate(wi.ranks):
        measured = [run[r] for run in runs]
        assert abs(low - min(measured)) <= 0.01 * min(measured), (what, r, wi.ranks, runs)
        assert max(measured) <= high, (what, r, wi.ranks, runs)


def _check_ddp(name, runs):
    cfg, spec = DDP_CONFIGS[name]
    wi = predict("mlp", spec, opt=cfg.get("opt", True))
    assert wi.peak_range[0] == wi.peak_range[1] and len(wi.ranks) == 2
    for run in runs:
        for measured in run:
            assert abs(wi.peak - measured) <= 0.001 * measured, (name, wi.peak, runs)


@pytest.mark.parametrize("name", FAST)
def test_ddp_per_rank_peak_matches_the_profiler(fast_truth, name):
    _check_ddp(name, fast_truth[name])


def test_fsdp2_fp32_reshard_per_rank_range_holds_every_run(fast_truth):
    wi = predict("mlp", gradscope.FSDP(2))
    check_range(wi, fast_truth["fsdp"], "fsdp")
    assert wi.peak == wi.peak_range[0] < wi.single  # sharding saves memory on this step
    text = str(wi)
    assert "FSDP on 2 ranks" in text and "sharded parameters" in text and "reduce-scatter" in text


@pytest.mark.slow
def test_ddp_without_optimizer_peaks_in_backward_with_the_buckets_alive():
    """No optimizer: the peak is in backward, where the bucket views hold every gradient from the start."""
    names = ["ddp-no-opt", "ddp-view-no-opt"]
    for name, runs in zip(names, measure("mlp", [DDP_CONFIGS[n][0] for n in names], world=2, runs=3)):
        _check_ddp(name, runs)


def test_ddp_buckets_are_one_gradient_copy_unless_they_are_the_grads():
    model = build("mlp")
    nparams = sum(p.numel() * p.element_size() for p in model.parameters())
    default = predict("mlp", gradscope.DDP(2))
    view = predict("mlp", gradscope.DDP(2, gradient_as_bucket_view=True))
    assert default.peak - default.single == nparams
    assert view.peak == view.single  # the peak is in optimizer.step(), where every .grad exists anyway
    assert "DDP gradient buckets" in str(default) and "every rank" in str(default)
    assert sum(default.parts[0].values()) == default.peak
    svg = default.to_svg()
    assert svg.count('class="gs-shard-high"') == 2 and svg.startswith("<svg")


def test_bad_specs_say_what_to_pass():
    with pytest.raises(InputTypeError, match="world_size"):
        gradscope.DDP("8")  # type: ignore[arg-type]
    with pytest.raises(InputValueError, match="at least 1"):
        gradscope.FSDP(0)
    with pytest.raises(InputValueError, match="divisor"):
        gradscope.FSDP(8, reshard_after_forward=3)
    with pytest.raises(InputTypeError, match="MixedPrecisionPolicy"):
        gradscope.FSDP(8, mp_policy="bf16")
    with pytest.raises(InputTypeError, match="shard= takes"):
        predict("mlp", 8)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    spec = gradscope.FSDP(4, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert spec.param_dtype == "bfloat16" and spec.reduce_dtype is None
    assert spec == gradscope.FSDP(4, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)) and hash(spec)
