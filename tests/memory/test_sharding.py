"""Per-rank DDP / FSDP2 memory predicted from one process, against real gloo runs measured per rank with
torch.profiler (``tests/_shardtruth.py``). Jobs of three steps (AdamW, ``zero_grad(set_to_none=True)``
between) unless said: ``ranks`` / ``peak_range`` is the steady state (the higher of step 1 and the later
steps, whose AdamW state is alive from their start) and must hold every run's highest step; ``first`` holds
step 1 and ``later`` steps 2-3. CPU offload runs one step (its host peak is measured on step 1)."""

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


@pytest.fixture(autouse=True)
def one_thread():
    """Each rank of the truth runs on one thread (``_shardtruth``): the predictions too, as the in-node memory
    of a kernel depends on the thread count it runs on (a bfloat16 matmul's scratch: NOTE [in-node memory])."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def predict(model_name: str, spec, n: int = 8, opt: bool = True, **kw):
    model = build(model_name)
    optimizer = torch.optim.AdamW(model.parameters()) if opt else None
    x = batch(model_name, n)  # held, as the rank holds its batch
    with gradscope.trace(model) as tr:
        loss = loss_of(model(x))
    report = gradscope.inspect(loss, model=model, trace=tr)
    return report.what_if(optimizer=optimizer, shard=spec, **kw)


FAST = ["ddp", "ddp-view"]
FSDP_FAST = {
    "fsdp": {"kind": "fsdp", "steps": 3},
    "fsdp-bf16": {"kind": "fsdp", "mp": True, "steps": 3},
    "fsdp-offload": {"kind": "fsdp", "offload": True},
}
STEPS = 3  # a job's steps, in the configs that say "steps"


def bf16_fp32_reduce():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def offload(world: int, **kw):
    """FSDP2 with CPU offload; unpinned, as a CPU-only torch cannot pin (the truth runs use the same)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return gradscope.FSDP(world, offload_policy=CPUOffloadPolicy(pin_memory=False), **kw)


def _split(names, measured) -> tuple[dict, dict, dict]:
    """Per name, per run, each rank's peak (of the whole job: its highest step); each rank's host peak under
    CPU offload; and per rank what gradscope said inside it on the wrapped model (configs with ``"inspect"``;
    see _shardtruth). ``peaks[(name, "steps")]``: per run, per rank, each step's peak (jobs of 3 steps)."""
    peaks: dict = {n: [[r["peak"] for r in run] for run in runs] for n, runs in zip(names, measured)}
    for key in ("steps", "low_steps"):
        peaks |= {(n, key): [[r[key] for r in run] for run in runs] for n, runs in zip(names, measured)
                  if key in runs[0][0]}
    hosts = {n: [[r.get("host") for r in run] for run in runs] for n, runs in zip(names, measured)}
    seen = {n: [r.get("inspected") for r in runs[0]] for n, runs in zip(names, measured)}
    return peaks, hosts, seen


def check_inspected(seen, wi, what):
    """Inside each rank, ``inspect(loss, model=wrapped)`` read the spec and the rank, and ``what_if()`` gave
    the per-rank step the unsharded model's ``what_if(shard=spec)`` gives (``wi``)."""
    for r, got in enumerate(seen):
        assert got["rank"] == got["wi_rank"] == r and got["spec"] == wi.spec.label(), (what, r, got)
        assert [tuple(x) for x in got["ranks"]] == wi.ranks, (what, r, got["ranks"], wi.ranks)


@pytest.fixture(scope="module")
def fast_truth():
    """The fast subset, measured in one process group: DDP default and bucket view, FSDP2 reshard True with
    the parameters in float32, in bfloat16 (float32 reduce), and in float32 with CPU offload; gradscope inside
    each rank on the wrapped model too, except under bfloat16 (the rank's graph is then in bfloat16)."""
    cfgs = [{**DDP_CONFIGS[n][0], "inspect": True, "steps": STEPS} for n in FAST] + [
        {**c, "inspect": not c.get("mp")} for c in FSDP_FAST.values()
    ]
    # the plan's code, run as written
    cfgs.append({"kind": "code", "code": _mixed_plan()[0].code, "n": PLAN_BATCH, "steps": STEPS})
    peaks, hosts, seen = _split(FAST + list(FSDP_FAST) + ["plan"], measure("mlp", cfgs, world=2, runs=3, key="all"))
    return peaks | {"host": hosts["fsdp-offload"], "inspected": seen}


PLAN_BATCH = 256  # activations outweigh the shards: bfloat16 parameters lower the peak


def _mixed_plan():
    """The MLP at batch 256 on 2 ranks, with a budget that only bfloat16 parameters (float32 reduce) fit
    without a checkpoint: ``(plan, (report, optimizer, the bfloat16 step, the float32 checkpointed step))``."""
    fp32 = predict("mlp", gradscope.FSDP(2), n=PLAN_BATCH)
    bf16 = predict("mlp", gradscope.FSDP(2, mp_policy=bf16_fp32_reduce()), n=PLAN_BATCH)
    ck = predict("mlp", gradscope.FSDP(2), n=PLAN_BATCH, checkpoint="blocks.*")
    assert bf16.high < ck.high < fp32.high  # bfloat16 is what fits: the checkpoint comes after it
    model = build("mlp")
    x = batch("mlp", PLAN_BATCH)
    with gradscope.trace(model) as tr:
        loss = loss_of(model(x))
    report = gradscope.inspect(loss, model=model, trace=tr)
    opt = torch.optim.AdamW(model.parameters())
    plan = report.plan((bf16.high + ck.high) // 2, optimizer=opt, shard=gradscope.FSDP(2), margin=0)
    return plan, (report, opt, bf16, ck)


def test_plan_switches_mixed_precision_on_and_its_code_runs_under_the_budget(fast_truth):
    """A budget only bfloat16 parameters fit: the plan says so, writes the code, and that code, run on 2 gloo
    ranks, peaks under the budget (every run, every rank) and inside the predicted range."""
    plan, (report, opt, bf16, ck) = _mixed_plan()
    assert plan.fits and plan.mixed_precision and plan.spec == bf16.spec and not plan.checkpoint
    assert plan.peak_range == bf16.peak_range and "FSDP(2): " in plan.tried[0] and "bfloat16" in plan.tried[1]
    assert "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in plan.code
    assert "numerics change" in plan.code.splitlines()[0] and "numerics change" in str(plan)
    runs = fast_truth["plan"]
    assert max(max(run) for run in runs) <= plan.budget, (runs, plan.budget)
    check_steps(plan.result, fast_truth[("plan", "steps")], "plan", fast_truth[("plan", "low_steps")])
    keep = report.plan(plan.budget, optimizer=opt, shard=gradscope.FSDP(2), margin=0, mixed_precision=False)
    assert not keep.mixed_precision and keep.spec.param_dtype is None and keep.peak_range == ck.peak_range
    assert "mixed precision" not in keep.code


def check_range(wi, runs, what, ranges=None, reach=True, lows=None):
    """Every run on every rank inside (floor - 1%, ceiling) of ``ranges`` (default ``wi.ranks``, the steady
    state); with ``reach``, the floor reached within 1% by some run. ``lows``: the same runs' lower bounds
    (tests/_shardtruth.py NOTE [lost frees]: a free the trace lost and whose address is not handed out again
    before the peak leaves the measurement between the two); a run is above the ceiling when its lower bound is.

    FSDP2's peak is not deterministic (a free lands before or after gloo's worker thread finishes), so one
    rank need not reach its floor in three runs. Ranks predicted alike (floors within 0.2%: the same shard
    sizes up to padding) are one population: the lowest run among them must reach their floor.
    """
    ranges = wi.ranks if ranges is None else ranges
    lows = runs if lows is None else lows
    groups: list = []  # [(lowest floor, measured)] of ranks whose floors are within 0.2%
    for r, (low, high) in enumerate(ranges):
        measured = [run[r] for run in runs]
        assert min(measured) >= low - 0.01 * low, ("a run below the floor", what, r, ranges, runs)
        assert max(run[r] for run in lows) <= high, ("a run above the ceiling", what, r, ranges, runs, lows)
        for g in groups:
            if abs(g[0] - low) <= 0.002 * low:
                g[0] = min(g[0], low)
                g[1].extend(measured)
                break
        else:
            groups.append([low, list(measured)])
    for low, measured in groups if reach else ():
        assert min(measured) - low <= 0.01 * min(measured), ("the floor is never reached", what, ranges, runs)


def check_host(wi, runs, what):
    """The host's peak under CPU offload within 0.1% of every run on every rank (it is deterministic)."""
    for run in runs:
        for r, measured in enumerate(run):
            assert abs(wi.host[r] - measured) <= 0.001 * measured, ("host", what, r, wi.host, runs)


def _check_ddp(name, runs, steps=None):
    """Every run (its highest step) within 0.1% of the steady state; with ``steps``, step 1 of ``first`` and
    steps 2-3 of ``later`` too."""
    cfg, spec = DDP_CONFIGS[name]
    wi = predict("mlp", spec, opt=cfg.get("opt", True))
    assert wi.peak_range[0] == wi.peak_range[1] and len(wi.ranks) == 2
    for run in runs:
        for measured in run:
            assert abs(wi.peak - measured) <= 0.001 * measured, (name, wi.peak, runs)
    for run in steps or ():
        for r, s in enumerate(run):
            assert abs(wi.first[r][0] - s[0]) <= 0.001 * s[0], (name, "step 1", wi.first, steps)
            assert all(abs(wi.later[r][0] - x) <= 0.001 * x for x in s[1:]), (name, "later", wi.later, steps)
    return wi


@pytest.mark.parametrize("name", FAST)
def test_ddp_per_rank_peak_matches_the_profiler(fast_truth, name):
    wi = _check_ddp(name, fast_truth[name], fast_truth[(name, "steps")])
    check_inspected(fast_truth["inspected"][name], wi, name)  # the same numbers from inside each rank


def check_steps(wi, steps, what, lows=None):
    """Per step of a 3-step job: step 1 inside ``wi.first``, steps 2 and 3 each inside ``wi.later`` (with an
    optimizer), the job (a run's highest step) inside ``wi.ranks``, the higher of the two. A floor must be
    reached by some step it is the floor of: each step is a sample (a late release of gloo's may lift any one
    step of a run, NOTE [lost frees] in tests/_shardtruth.py; a job's highest step is the likeliest lifted)."""
    lows = steps if lows is None else lows

    def pick(runs, f):
        return [[f(s) for s in run] for run in runs]

    check_range(wi, pick(steps, lambda s: s[0]), (what, "step 1"), wi.first, lows=pick(lows, lambda s: s[0]))
    later = [[s[k] for s in run] for run in steps for k in (1, 2)]
    check_range(wi, later, (what, "later steps"), wi.later, lows=[[s[k] for s in run] for run in lows for k in (1, 2)])
    check_range(wi, pick(steps, max), (what, "job"), reach=False, lows=pick(lows, max))
    assert wi.ranks == [max(a, b) for a, b in zip(wi.first, wi.later)]


def test_fsdp2_fp32_reshard_per_rank_range_holds_every_run(fast_truth):
    wi = predict("mlp", gradscope.FSDP(2))
    check_steps(wi, fast_truth[("fsdp", "steps")], "fsdp", fast_truth[("fsdp", "low_steps")])
    assert min(lo for lo, _ in wi.later) > max(lo for lo, _ in wi.first)  # AdamW's state: later steps higher
    check_inspected(fast_truth["inspected"]["fsdp"], wi, "fsdp")
    assert wi.peak == wi.peak_range[0] < wi.single  # sharding saves memory on this step
    text = str(wi)
    assert "what if: FSDP(2), per rank" in text and "sharded parameters" in text and "reduce-scatter" in text


def test_fsdp2_bf16_params_fp32_reduce_per_rank_range_holds_every_run(fast_truth):
    wi = predict("mlp", gradscope.FSDP(2, mp_policy=bf16_fp32_reduce()))
    check_steps(wi, fast_truth[("fsdp-bf16", "steps")], "fsdp-bf16", fast_truth[("fsdp-bf16", "low_steps")])
    fp32 = predict("mlp", gradscope.FSDP(2))
    # the shards, their gradients and AdamW's state stay in float32: the same sharded parameters
    assert wi.parts[0]["sharded parameters (padded)"] == fp32.parts[0]["sharded parameters (padded)"]
    text = str(wi).replace("\n    ", " ")  # traced: the casts to float32 followed, no lower bound
    assert "FSDP(2, bfloat16)" in text and "followed by gradscope.trace" in text and "lower bound" not in text


def test_fsdp2_cpu_offload_per_rank_range_and_host_hold_every_run(fast_truth):
    wi = predict("mlp", offload(2))
    check_range(wi, fast_truth["fsdp-offload"], "fsdp-offload", wi.first)  # one step
    check_host(wi, fast_truth["host"], "fsdp-offload")
    check_inspected(fast_truth["inspected"]["fsdp-offload"], wi, "fsdp-offload")
    assert wi.ranks == predict("mlp", gradscope.FSDP(2)).ranks  # on the CPU the device is the host
    assert sum(wi.host_parts[0].values()) == wi.host[0] and wi.host_parts[0]["gradients (sharded)"] > 0
    text = str(wi)
    assert "FSDP(2, CPU offload)" in text and "on the host (CPU offload)" in text and "the device is the host" in text


def _meta_report(name: str):
    with torch.device("meta"):
        model = build(name)
        x = batch(name, 8).to("meta")
        opt = torch.optim.AdamW(model.parameters())
    with gradscope.trace(model) as tr:
        loss = loss_of(model(x))
    return gradscope.inspect(loss, model=model, trace=tr), opt


def test_fsdp2_cpu_offload_on_an_accelerator_moves_shards_grads_and_the_step_to_the_host(fast_truth):
    """Traced on meta (an accelerator): the device keeps no shard, gradient or optimizer state; the host's side
    is what the gloo runs measured (the host's memory does not depend on the device)."""
    report, opt = _meta_report("mlp")
    kept = report.what_if(optimizer=opt, shard=gradscope.FSDP(2))
    off = report.what_if(optimizer=opt, shard=offload(2))
    assert off.device == "meta" and off.peak < kept.peak
    assert "sharded parameters (padded)" not in off.parts[0] and "sharded parameters (padded)" in kept.parts[0]
    assert sum(off.parts[0].values()) == off.ranks[0][0]
    check_host(off, fast_truth["host"], "meta")
    assert "modelled, not measured" in str(off)


def test_cuda_target_with_a_shard_spec_predicts_the_device_apart_from_the_host(fast_truth):
    """target="cuda" on a CPU trace: the device's side under CPU offload (NCCL's buffers modelled, not
    measured), the host's as measured on gloo."""
    model, report = _gpt_report("mlp")
    opt = torch.optim.AdamW(model.parameters())
    cpu = report.what_if(optimizer=opt, shard=offload(2))
    cuda = report.what_if(optimizer=opt, shard=offload(2), target="cuda")
    assert cuda.device.startswith("cuda") and cuda.peak < cpu.peak and cuda.high == cuda.peak
    assert "sharded parameters (padded)" not in cuda.parts[0] and cuda.host == cpu.host
    check_host(cuda, fast_truth["host"], "cuda")
    assert "NCCL" in str(cuda) and "modelled, not measured" in str(cuda)


def test_plan_on_an_accelerator_offloads_when_checkpointing_is_not_enough():
    report, opt = _meta_report("mlp")  # parameters outweigh activations: offload saves more than a checkpoint
    ck = report.what_if(optimizer=opt, shard=gradscope.FSDP(2), checkpoint="blocks.*")
    off = report.what_if(optimizer=opt, shard=offload(2))
    assert off.high < ck.high
    fp32 = {"margin": 0, "mixed_precision": False}  # the float32 order (mixed precision: its own test)
    plan = report.plan((off.high + ck.high) // 2, optimizer=opt, shard=gradscope.FSDP(2), **fp32)
    assert plan.fits and plan.spec.offload and not plan.checkpoint and plan.peak_range == off.peak_range
    assert "offload_policy=CPUOffloadPolicy()" in plan.code and "CPU offload" in plan.tried[-1]
    cpu = _gpt_report("mlp")[1].plan(1000, optimizer=opt, shard=gradscope.FSDP(2))
    assert not cpu.fits and "moves nothing on the CPU" in str(cpu)
    assert not any("offload" in t for t in cpu.tried)


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


# The slow grid: FSDP2 on an MLP stack, a small transformer and HF Llama (tiny config), parameters in their
# own dtype (float32) or bfloat16 with a float32 reduce ("bf16"), without offload; reshard True / False at 2
# ranks and an int at 4; with and without a checkpoint per block. Measured misses are strict xfails with the
# measured numbers (docs/sharding.md lists them).
GRID = [
    (model, world, reshard, ckpt, prec)
    for model in ("mlp", "gpt", "llama")
    for world, reshards in ((2, (True, False)), (4, (2,)))
    for reshard in reshards
    for ckpt in (False, True)
    for prec in ("fp32", "bf16")
]
MISSES: dict[tuple, str] = {
    # none (2026-12-03). Llama with bfloat16 parameters and a checkpoint per block was 2.6% / 2.9% low: each
    # block's bfloat16 input, which only its checkpoint holds once RMSNorm saves a float32 copy; now 128 B under
    # the lowest run (the int64 position ids the checkpoints hold, which no node shows; the float32 Llama's gap
    # too). The MLP and the transformer at 4 ranks in bfloat16 (peak inside an AddmmBackward0) were 1.1% to 9.1%
    # low on this host until in-node memory was measured on the bfloat16 kernels (NOTE [in-node memory])
}


def _grid_params():
    out = []
    for key in GRID:
        marks = [pytest.mark.slow]
        if key in MISSES:
            marks.append(pytest.mark.xfail(strict=True, reason=MISSES[key]))
        out.append(pytest.param(*key, marks=marks, id="-".join(map(str, key))))
    return out


_GRID_TRUTH: dict = {}


# CPU offload on the MLP stack and the transformer, the same settings: the per-rank range and the host's peak;
# "offload" in float32, "offload-bf16" with bfloat16 parameters and a float32 reduce too (2 ranks)
OFFLOAD_GRID = [(*k[:4], "offload") for k in GRID if k[0] in ("mlp", "gpt") and k[4] == "fp32"]
OFFLOAD_GRID += [(*k[:4], "offload-bf16") for k in GRID if k[0] in ("mlp", "gpt") and k[4] == "fp32" and k[1] == 2]


def _grid_truth(model: str, world: int) -> dict:
    """All configs of one model and world size, measured in one process group (3 runs each); a key whose
    precision starts with ``"offload"`` is a config with CPU offload, ``"host"`` appended its host's peaks."""
    if (model, world) not in _GRID_TRUTH:
        keys = [k for k in GRID if k[:2] == (model, world)]
        keys += [k for k in OFFLOAD_GRID if k[:2] == (model, world)]
        cfgs = [{"kind": "fsdp", "reshard": k[2], "ckpt": k[3], "mp": "bf16" in k[4], "offload": "offload" in k[4],
                 "inspect": not k[3] and "bf16" not in k[4], "steps": 1 if "offload" in k[4] else STEPS} for k in keys]
        peaks, hosts, seen = _split(keys, measure(model, cfgs, world=world, runs=3, key="all"))
        _GRID_TRUTH[(model, world)] = {(*k[0], k[1]) if k[-1] in ("steps", "low_steps") else k: v
                                       for k, v in peaks.items()}
        _GRID_TRUTH[(model, world)] |= {(*k, "host"): v for k, v in hosts.items() if "offload" in k[4]}
        _GRID_TRUTH[(model, world)] |= {(*k, "inspected"): v for k, v in seen.items()
                                        if not k[3] and "bf16" not in k[4]}
    return _GRID_TRUTH[(model, world)]


@pytest.mark.slow
@pytest.mark.parametrize("model, world, reshard, ckpt, prec", OFFLOAD_GRID, ids=lambda v: str(v))
def test_fsdp2_cpu_offload_grid_per_rank_range_and_host_hold_every_run(model, world, reshard, ckpt, prec):
    from tests._shardmodels import SHARDED

    truth = _grid_truth(model, world)
    key = (model, world, reshard, ckpt, prec)
    mp = bf16_fp32_reduce() if "bf16" in prec else None
    wi = predict(model, offload(world, modules=[SHARDED[model]], reshard_after_forward=reshard, mp_policy=mp),
                 checkpoint=SHARDED[model] if ckpt else None)
    check_range(wi, truth[key], key, wi.first)  # one step
    check_host(wi, truth[(*key, "host")], key)
    if not ckpt and not mp:
        check_inspected(truth[(*key, "inspected")], wi, key)


@pytest.mark.parametrize("model, world, reshard, ckpt, prec", _grid_params())
def test_fsdp2_grid_per_rank_range_holds_every_run(model, world, reshard, ckpt, prec):
    from tests._shardmodels import SHARDED

    key = (model, world, reshard, ckpt, prec)
    runs = _grid_truth(model, world)[key]
    mp = bf16_fp32_reduce() if prec == "bf16" else None
    spec = gradscope.FSDP(world, modules=[SHARDED[model]], reshard_after_forward=reshard, mp_policy=mp)
    wi = predict(model, spec, checkpoint=SHARDED[model] if ckpt else None)
    assert runs  # each run's highest step: inside wi.ranks (check_steps' "job")
    truth = _grid_truth(model, world)
    check_steps(wi, truth[(*key, "steps")], key, truth[(*key, "low_steps")])
    if not ckpt and prec != "bf16":  # the prediction made inside each rank on the fully_shard-ed model
        check_inspected(_grid_truth(model, world)[(*key, "inspected")], wi, key)


def _gpt_report(name: str = "gpt"):
    model = build(name)
    x = batch(name, 8)
    with gradscope.trace(model) as tr:
        loss = loss_of(model(x))
    return model, gradscope.inspect(loss, model=model, trace=tr)


def test_plan_picks_the_first_setting_whose_ceiling_fits_and_writes_its_code():
    model, report = _gpt_report()
    opt = torch.optim.AdamW(model.parameters())
    kept = gradscope.FSDP(2, reshard_after_forward=False)
    tried = [
        report.what_if(optimizer=opt, shard=kept),
        report.what_if(optimizer=opt, shard=gradscope.FSDP(2)),
        report.what_if(optimizer=opt, shard=gradscope.FSDP(2), checkpoint="blocks.*"),
    ]
    budget = (tried[1].high + tried[2].high) // 2  # between resharding and resharding + checkpoint
    plan = report.plan(budget, optimizer=opt, shard=kept, margin=0, mixed_precision=False)
    assert plan.fits and plan.spec == gradscope.FSDP(2) and plan.checkpoint == ["blocks.0", "blocks.1", "blocks.2"]
    assert plan.peak_range == tried[2].peak_range and tried[0].high > budget and tried[1].high > budget
    assert all(model.get_submodule(n) is not None for n in plan.checkpoint)
    assert "fully_shard(model.get_submodule(name), mesh=mesh)" in plan.code and "use_reentrant=False" in plan.code
    one = report.what_if(optimizer=opt).peak  # one process, at its later steps (AdamW's state from the start)
    assert report.plan(one, optimizer=opt, shard="auto", margin=0).spec is None  # one process fits its own peak
    auto = report.plan(budget, optimizer=opt, shard="auto", margin=0, mixed_precision=False)
    assert auto.fits and auto.spec == gradscope.FSDP(2) and auto.peak_range == tried[2].peak_range
    assert one > budget >= tried[2].high
    assert not report.plan(1000, optimizer=opt, shard="auto").fits


def test_max_batch_per_rank_is_the_largest_batch_whose_ceiling_fits():
    model, report = _gpt_report()
    opt = torch.optim.AdamW(model.parameters())
    spec = gradscope.FSDP(2)
    budget = report.what_if(optimizer=opt, shard=spec, batch=3).high + 1
    mb = report.max_batch(budget, optimizer=opt, shard=spec, margin=0)
    assert mb.batch_size == 8 and mb.fits and mb.peak <= budget
    assert report.what_if(optimizer=opt, shard=spec, batch=(mb.batch + 1) / 8).high > budget
