"""``gradscope memory TARGET``: the budget gate's exit codes and its one-line errors."""

from __future__ import annotations

import textwrap

import pytest

from tests.cli.conftest import run_memory as _run  # the `target` fixture: tests/cli/conftest.py

_TARGET = """
import torch
from torch import nn

def step():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    return m(torch.randn(128, 64)).pow(2).mean(), m

def loss_only():
    w = torch.randn(8, 8, requires_grad=True)
    return (w @ w).sum()

def freed():
    w = torch.randn(3, 3, requires_grad=True)
    loss = (w @ w).sum()
    loss.backward()
    return loss
"""


def test_prints_the_budget_and_fits(target):
    res = _run(f"{target}:step", "--optimizer", "adamw", "--budget", "16GiB")
    assert res.exit_code == 0, res.output
    assert "absolute peak of the step" in res.output and "AdamW.step()" in res.output
    assert "the step fits" in res.output


def test_budget_gate_exits_1_when_the_peak_exceeds_it(target, tmp_path):
    res = _run(f"{target}:step", "--optimizer", "adamw", "--budget", "300KiB", "--svg", str(tmp_path / "c.svg"))
    assert res.exit_code == 1, res.output
    assert "does NOT fit" in res.output
    assert (tmp_path / "c.svg").read_text().startswith("<svg")


@pytest.mark.parametrize("size", ["16 GB", "16GiB", "512MiB", "1000000000"])
def test_budget_sizes_parse(target, size):
    assert _run(f"{target}:step", "--budget", size).exit_code == 0


@pytest.mark.parametrize("args,words", [
    (["--budget", "lots"], "is not a size"),
    (["--optimizer", "adamw"], "needs the model"),
])
def test_bad_input_is_one_line_without_traceback(target, args, words):
    res = _run(f"{target}:loss_only", *args)
    assert res.exit_code == 2
    assert words in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_freed_graph_is_one_line(target):
    res = _run(f"{target}:freed")
    assert res.exit_code == 2 and "has not freed" in res.output and "Traceback" not in res.output


def test_unknown_optimizer_name_is_a_usage_error(target):
    res = _run(f"{target}:step", "--optimizer", "lion")
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_first_measurement_prints_no_profiler_noise(tmp_path):
    """The first run on a machine measures in-node memory with a profiler session, whose kineto prints
    "USDT: ... profiler_start" to stderr: gradscope silences its own session, with no setting changed."""
    import os
    import subprocess
    import sys

    path = tmp_path / "conv.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def step():
            torch.manual_seed(0)
            m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
            return m(torch.randn(2, 3, 16, 16)).mean(), m
    """))
    env = {**os.environ, "GRADSCOPE_CACHE": str(tmp_path / "cache")}
    env.pop("KINETO_LOG_LEVEL", None)
    done = subprocess.run([sys.executable, "-m", "gradscope", "memory", f"{path}:step"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "in-node memory" in done.stdout and any((tmp_path / "cache").iterdir())  # it did measure
    assert "USDT" not in done.stderr and "profiler_start" not in done.stderr, done.stderr


def test_plan_without_budget_refuses_before_the_replay(target, monkeypatch):
    import gradscope.memory.replay.backward as backward

    def no_replay(*a, **k):
        raise AssertionError("the replay ran before --plan was refused")

    monkeypatch.setattr(backward, "backward_memory", no_replay)
    monkeypatch.setattr(backward, "replay", no_replay)
    res = _run(f"{target}:step", "--plan")
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [
        "Error: --plan needs --budget SIZE (the memory the plan must fit in), e.g. --budget 16GiB."
    ]


@pytest.mark.parametrize("size,said", [("16GB", "budget 16GB read as 16,000,000,000 bytes = 14.9 GiB"),
                                       ("300 kB", "budget 300 kB read as 300,000 bytes = 293.0 KiB"),
                                       ("16GiB", None)])
def test_a_decimal_budget_says_how_it_was_read(target, size, said):
    res = _run(f"{target}:step", "--budget", size)
    assert res.exit_code in (0, 1), res.output
    if said is None:
        assert "read as" not in res.stderr
    else:
        assert said in res.stderr and "1 " + size.split()[-1][-2:].upper() + " = 10^" in res.stderr
        assert f"budget {said.split('= ')[-1]}:" in res.stdout  # the verdict uses the bytes it said
