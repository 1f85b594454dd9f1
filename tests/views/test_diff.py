"""gradscope.diff and `gradscope diff a.json b.json`, checked against what torch does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradscope
from gradscope.cli.diff import diff_cmd
from gradscope.errors import InputTypeError


class Block(nn.Module):
    def __init__(self, d=16, ckpt=False, extra_relu=False):
        super().__init__()
        self.ckpt = ckpt
        self.extra_relu = extra_relu
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, 1)
        self.unused = nn.Linear(d, d)

    def forward(self, x, use_unused=False):
        h = checkpoint(self.mlp, x, use_reentrant=False) if self.ckpt else self.mlp(x)
        if self.extra_relu:
            h = h.relu()
        if use_unused:
            h = self.unused(h)
        return self.head(h).sum()


def report_of(model, x, **kw):
    return gradscope.inspect(model(x, **kw), model=model)


def write(report, path):
    path.write_text(json.dumps(report.to_json()))
    return str(path)


@pytest.fixture
def x():
    return torch.randn(8, 16, requires_grad=True)


def test_diff_with_itself_is_empty(x):
    r = report_of(Block(), x)
    d = gradscope.diff(r, r)
    assert not d and d.ops == {} and d.modules == {} and not d.appeared and not d.disappeared
    assert "no differences" in str(d)
    m = Block()                                        # two walks of the same program
    assert not gradscope.diff(report_of(m, x), report_of(m, x))


def test_checkpoint_drops_held_bytes(x):
    torch.manual_seed(0)
    plain_model = Block()
    ck_model = Block(ckpt=True)
    ck_model.load_state_dict(plain_model.state_dict())
    plain, ck = report_of(plain_model, x), report_of(ck_model, x)
    d = gradscope.diff(plain, ck)
    assert d
    a, b = d.totals["activations"]
    assert b < a
    assert d.totals["recomputed"][0] == 0 and d.totals["recomputed"][1] > 0
    assert d.ops == {}                                   # non-reentrant checkpoint keeps the same graph
    before, after = d.modules["mlp.0"]
    assert before.held > 0 and after.held == 0 and after.recomputed > 0
    before, after = d.modules["mlp.2"]             # the region's last op lists what checkpoint keeps: x
    assert after.held == x.numel() * 4 < before.held and after.recomputed > 0
    assert "recomputed by checkpoint" in str(d) and "mlp.0" in str(d)
    # torch agrees that the checkpointed model computes the same gradients
    ck_model(x).backward()
    g_ck = ck_model.mlp[0].weight.grad.clone()
    plain_model(x).backward()
    assert torch.allclose(g_ck, plain_model.mlp[0].weight.grad, atol=1e-6)


def test_save_on_cpu_shows_moved_bytes(x):
    m = Block()
    plain = report_of(m, x)
    with torch.autograd.graph.save_on_cpu():
        moved = report_of(m, x)
    d = gradscope.diff(plain, moved)
    assert d.totals["saved_bytes"] == (plain.saved_bytes, 0)
    assert d.totals["offloaded"] == (0, plain.saved_bytes)
    assert "moved to CPU" in str(d)


def test_ops_and_params_added_removed(x):
    torch.manual_seed(0)
    a = Block()
    b = Block(extra_relu=True)
    b.load_state_dict(a.state_dict())
    ra, rb = report_of(a, x), report_of(b, x, use_unused=True)
    d = gradscope.diff(ra, rb)
    assert d.ops["ReluBackward0"] == (0, 1)
    assert d.added["ReluBackward0"] == 1 and d.added["AddmmBackward0"] == 1
    assert d.params_added == ("unused.bias", "unused.weight") and d.params_removed == ()
    assert gradscope.diff(rb, ra).removed["ReluBackward0"] == 1


def test_findings_appear_and_disappear(x):
    m = Block()
    broken, fixed = report_of(m, x), report_of(m, x, use_unused=True)
    m.zero_grad(set_to_none=True)
    m(x).backward()                                     # torch: `unused` gets no gradient in the broken one
    assert m.unused.weight.grad is None
    d = gradscope.diff(broken, fixed)
    gone = {p for f in d.disappeared for p in f.params}
    assert gone == {"unused.weight", "unused.bias"} and not d.appeared
    back = gradscope.diff(fixed, broken)
    assert {p for f in back.appeared for p in f.params} == gone
    assert "findings that disappeared" in str(d)


def test_json_round_trip(tmp_path, x):
    torch.manual_seed(0)
    a, b = Block(), Block(ckpt=True)
    b.load_state_dict(a.state_dict())
    ra, rb = report_of(a, x), report_of(b, x)
    pa, pb = write(ra, tmp_path / "a.json"), write(rb, tmp_path / "b.json")
    la, lb = gradscope.load(pa), gradscope.load(pb)
    assert not gradscope.diff(ra, la) and not gradscope.diff(rb, lb)
    assert str(gradscope.diff(la, lb)) == str(gradscope.diff(ra, rb))


def test_diff_needs_reports():
    with pytest.raises(InputTypeError, match="report_b is dict"):
        gradscope.diff(gradscope.inspect(nn.Linear(2, 1)(torch.randn(1, 2)).sum()), {})


def test_cli_diff(tmp_path, x):
    torch.manual_seed(0)
    a, b = Block(), Block(ckpt=True)
    b.load_state_dict(a.state_dict())
    pa, pb = write(report_of(a, x), tmp_path / "a.json"), write(report_of(b, x), tmp_path / "b.json")
    runner = CliRunner()
    res = runner.invoke(diff_cmd, [pa, pb])
    assert res.exit_code == 0, res.output
    assert "activations held" in res.output and "recomputed" in res.output
    assert "no differences" in runner.invoke(diff_cmd, [pa, pa]).output
    assert runner.invoke(diff_cmd, [pa, pb, "--exit-code"]).exit_code == 1
    assert runner.invoke(diff_cmd, [pa, pa, "--exit-code"]).exit_code == 0
    res = runner.invoke(diff_cmd, [pa, pb, "--by", "op"])
    assert res.exit_code == 0 and "[before] Saved-tensor memory by op" in res.output
    res = runner.invoke(diff_cmd, [pa, pb, "--depth", "1", "--by", "module"])
    assert res.exit_code == 0 and "mlp.0" not in res.output and "mlp " in res.output
    res = runner.invoke(diff_cmd, [pa, pb, "--depth", "0"])
    assert res.exit_code == 2 and "Traceback" not in res.output


@pytest.mark.parametrize("content, needle", [
    (None, "no such report file"),
    ("not json", "is not JSON"),
    ("[1, 2]", "not a gradscope report"),
    ('{"nodes": [{"id": "n0"}], "links": []}', "not a gradscope report"),
])
def test_cli_diff_user_mistakes(tmp_path, x, content, needle):
    good = write(report_of(Block(), x), tmp_path / "good.json")
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    res = CliRunner().invoke(diff_cmd, [good, str(bad)])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in res.output


def test_cli_diff_directory_and_registered_command(tmp_path):
    res = subprocess.run([sys.executable, "-m", "gradscope", "diff", str(tmp_path), str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert "directory" in res.stderr


def test_diff_svg_pairs_before_and_after(x):
    import xml.etree.ElementTree as ET

    torch.manual_seed(0)
    a, b = Block(), Block(ckpt=True)
    b.load_state_dict(a.state_dict())
    d = gradscope.diff(report_of(a, x), report_of(b, x))
    text = "".join(ET.fromstring(d.to_svg(top=2)).itertext())
    first, second = list(d.modules)[:2]
    for name in (first, second):
        assert f"{name} before" in text and f"{name} after" in text


class _Scaled(nn.Module):
    """``scale`` runs ``times`` multiplications by a Python number: ops that save nothing."""

    def __init__(self, times):
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.scale = _Times(times)

    def forward(self, x):
        return self.scale(self.body(x)).sum()


class _Times(nn.Module):
    def __init__(self, times):
        super().__init__()
        self.times = times

    def forward(self, x):
        for _ in range(self.times):
            x = x * 2.0
        return x


def test_a_module_whose_ops_changed_but_not_its_bytes_is_not_listed(x):
    torch.manual_seed(0)
    one, three = _Scaled(1), _Scaled(3)
    three.load_state_dict(one.state_dict())
    with gradscope.trace() as t1:
        loss1 = one(x)
    with gradscope.trace() as t3:
        loss3 = three(x)
    a, b = gradscope.inspect(loss1, model=one, trace=t1), gradscope.inspect(loss3, model=three, trace=t3)
    rows_a, rows_b = a.memory(), b.memory()
    assert rows_a.row("scale").nodes < rows_b.row("scale").nodes        # the module did change its ops
    assert rows_a.row("scale").held == rows_b.row("scale").held == 0    # ... and holds nothing either way
    d = gradscope.diff(a, b)
    assert d.ops == {"MulBackward0": (1, 3)} and "scale" not in d.modules
    assert "0 B -> " not in str(d) and "MulBackward0 (1 -> 3)" in str(d)
