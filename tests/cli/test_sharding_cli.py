"""``gradscope memory TARGET --ddp N`` / ``--fsdp N``: the per-rank step, its budget gate and its errors."""

from __future__ import annotations

import textwrap

import pytest
import torch

import gradscope
from gradscope._format import human_bytes
from tests.cli.conftest import run_memory as _run  # the `target` fixture: tests/cli/conftest.py

_TARGET = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)
    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(3)))
        self.head = nn.Linear(64, 4)
    def forward(self, x):
        return self.head(self.blocks(x))

def step():
    torch.manual_seed(0)
    m = Net()
    return m(torch.randn(16, 64)).pow(2).mean(), m
"""


def _library_peak(target, spec) -> int:
    return _library_range(target, spec)[0]


def _library_range(target, spec, checkpoint=False, n=16) -> tuple[int, int]:
    import importlib.util

    s = importlib.util.spec_from_file_location("shard_target", target)
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    torch.manual_seed(0)
    m = mod.Net()
    with gradscope.trace(m) as tr:  # the batch is not held, as in the target
        loss = m(torch.randn(n, 64)).pow(2).mean()
    report = gradscope.inspect(loss, model=m, trace=tr)
    opt = torch.optim.AdamW(m.parameters())
    return report.what_if(optimizer=opt, shard=spec, checkpoint="blocks.*" if checkpoint else None).peak_range


def test_ddp_prints_the_library_per_rank_peak_and_gates_the_budget(target, tmp_path):
    svg = str(tmp_path / "r.svg")
    res = _run(f"{target}:step", "--optimizer", "adamw", "--ddp", "4", "--budget", "1GiB", "--svg", svg)
    assert res.exit_code == 0, res.output
    assert "what if: DDP(4), per rank" in res.output and "DDP gradient buckets" in res.output and "fits" in res.output
    assert human_bytes(_library_peak(target, gradscope.DDP(4))) in res.output
    assert (tmp_path / "r.svg").read_text().count('class="gs-shard-high"') == 4
    res = _run(f"{target}:step", "--optimizer", "adamw", "--ddp", "4", "--budget", "100KiB")
    assert res.exit_code == 1 and "does NOT fit" in res.output, res.output


def test_fsdp_prints_the_library_per_rank_range(target):
    res = _run(f"{target}:step", "--optimizer", "adamw", "--fsdp", "2")
    assert res.exit_code == 0, res.output
    assert "what if: FSDP(2), per rank" in res.output
    assert human_bytes(_library_peak(target, gradscope.FSDP(2))) in res.output
    res = _run(f"{target}:step", "--fsdp", "2", "--shard-modules", "layers.*")
    assert res.exit_code == 2 and "matches no module" in res.output and "Traceback" not in res.output


def test_fsdp_plan_prints_the_setting_that_fits_and_gates(target):
    res = _run(f"{target}:step", "--optimizer", "adamw", "--fsdp", "2", "--budget", "1GiB", "--plan")
    assert res.exit_code == 0, res.output
    assert "FSDP(2) fits" in res.output and "fully_shard(model.get_submodule(name), mesh=mesh)" in res.output
    res = _run(f"{target}:step", "--optimizer", "adamw", "--fsdp", "2", "--budget", "10KiB", "--plan")
    assert res.exit_code == 1 and "nothing tried fits" in res.output, res.output


def test_fsdp_plan_switches_mixed_precision_on_when_only_it_fits(tmp_path, monkeypatch):
    """At batch 1024 activations dominate: bfloat16 parameters (float32 reduce) fit a budget that float32
    needs a checkpoint for; the plan says the numerics change and writes the policy."""
    monkeypatch.setenv("GRADSCOPE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "big.py"
    path.write_text(textwrap.dedent(_TARGET).replace("randn(16, 64)", "randn(1024, 64)"))
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    bf16 = _library_range(str(path), gradscope.FSDP(2, mp_policy=mp), n=1024)
    ck = _library_range(str(path), gradscope.FSDP(2), True, n=1024)
    assert bf16[1] < ck[1]
    budget = str((bf16[1] + ck[1]) // 2 * 100 // 98)  # the plan keeps a 2% margin
    res = _run(f"{path}:step", "--optimizer", "adamw", "--fsdp", "2", "--budget", budget, "--plan")
    assert res.exit_code == 0, res.output
    assert "FSDP(2, bfloat16) fits" in res.output and "mixed precision switched on" in res.output
    assert "numerics change" in res.output and "reduce_dtype=torch.float32)" in res.output


@pytest.mark.parametrize(
    "args, words",
    [
        (["--ddp", "2", "--fsdp", "2"], "not both"),
        (["--bucket-view"], "go with --fsdp N / --ddp N"),
        (["--ddp", "0"], "0"),
    ],
)
def test_shard_option_mistakes_are_one_line_usage_errors(target, args, words):
    res = _run(f"{target}:step", *args)
    assert res.exit_code == 2, res.output
    assert words in res.output and "Traceback" not in res.output
