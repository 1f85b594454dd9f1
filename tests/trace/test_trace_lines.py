"""``trace()`` gives every op node the user's line that made it (node attribute ``location``).

Ground truth: the source lines themselves (marker comments ``# L:name`` in this file) and torch's own
record of where each node was made, anomaly mode's creation traceback (``node.metadata["traceback_"]``),
read for every node of the same forward.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import textwrap
import types
import warnings
import weakref
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradscope
from gradscope.cli.commands import main
from tests._zoo import Linears
from tests.fuzz._vocab import ScaleF

HERE = Path(__file__).name
_SOURCE = Path(__file__).read_text(encoding="utf-8").splitlines()
_TORCH = os.path.dirname(torch.__file__) + os.sep
_GRADSCOPE = os.path.dirname(gradscope.__file__) + os.sep  # all of it is skipped but demo.py (user code)


def line(marker: str) -> str:
    """``"test_trace_lines.py:N"`` of the one source line carrying ``# L:marker``."""
    hits = [i + 1 for i, text in enumerate(_SOURCE) if text.rstrip().endswith(f"# L:{marker}")]
    assert len(hits) == 1, (marker, hits)
    return f"{HERE}:{hits[0]}"


def by_name(report) -> dict[str, set]:
    """op name -> the locations its nodes got."""
    out: dict[str, set] = {}
    for _, d in report.graph.nodes(data=True):
        if d["kind"] == "op":
            out.setdefault(d["name"], set()).add(d.get("location"))
    return out


def torch_lines(root) -> dict[int, str | None]:
    """seq -> the user's line torch's anomaly mode recorded when it made that node (its own truth)."""
    out: dict[int, str | None] = {}
    stack, seen = [root.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions)
        if type(node).__name__ == "AccumulateGrad":
            continue
        where = None
        for frame in reversed(node.metadata.get("traceback_") or []):
            m = re.search(r'File "(.+?)", line (\d+)', frame)
            if m and not m.group(1).startswith((_TORCH, _GRADSCOPE)):
                where = f"{os.path.basename(m.group(1))}:{m.group(2)}"
                break
        out[node._sequence_nr()] = where
    return out


def traced(forward, model=None):
    """(report, torch's lines by seq) of one forward run under trace() and anomaly mode together."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anomaly mode's "may slow down" warning
        with torch.autograd.set_detect_anomaly(True), gradscope.trace(model) as tr:
            loss = forward()
    report = gradscope.inspect(loss, model=model, trace=tr)
    return report, torch_lines(loss), loss


def assert_matches_torch(report, truth) -> int:
    got = {d["seq"]: d.get("location") for _, d in report.graph.nodes(data=True) if d["kind"] == "op"}
    assert got.keys() == truth.keys()
    wrong = {s: (got[s], truth[s]) for s in got if got[s] != truth[s]}
    assert not wrong, wrong
    return len(got)


# -- the recorded line ------------------------------------------------------------------------------
def _user_fn(x):
    h = x.sin()  # L:user-sin
    return (h * 2).sum()  # L:user-mul-sum


def test_ops_made_in_a_user_function_get_its_lines():
    x = torch.randn(4, requires_grad=True)
    report, truth, _ = traced(lambda: _user_fn(x))
    names = by_name(report)
    assert names["SinBackward0"] == {line("user-sin")}
    assert names["MulBackward0"] == names["SumBackward0"] == {line("user-mul-sum")}
    assert assert_matches_torch(report, truth) == 3


class Block(nn.Module):
    """Defined here: its ops get the lines of this forward; torch's own modules the line calling them."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.act = nn.GELU()

    def forward(self, x):
        h = self.fc(self.norm(x))  # L:block-fc
        h = self.act(h)  # L:block-act
        return x + h * 0.5  # L:block-residual


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)  # L:net-block
        return self.head(x).pow(2).mean()  # L:net-head


def test_ops_in_a_module_forward_get_the_line_in_that_forward_and_torch_modules_their_callers_line():
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(3, 8)
    report, truth, _ = traced(lambda: net(x), net)
    names = by_name(report)
    assert names["NativeLayerNormBackward0"] == {line("block-fc")}  # nn.LayerNorm: the line calling it
    assert names["GeluBackward0"] == {line("block-act")}
    assert names["AddBackward0"] == {line("block-residual")}
    assert names["PowBackward0"] == names["MeanBackward0"] == {line("net-head")}
    # nn.Linear: its addmm and the weight's transpose take the line that called the Linear
    ops = [d for _, d in report.graph.nodes(data=True) if d["kind"] == "op"]
    assert {d["location"] for d in ops if d["module"] == "blocks.1.fc"} == {line("block-fc")}
    assert {d["location"] for d in ops if d["module"] == "head"} == {line("net-head")}
    assert assert_matches_torch(report, truth) == 16  # 8 per block (incl. the transposes), 4 in the head


def _region(t):
    u = t.tanh()  # L:region-tanh
    return u * t  # L:region-mul


def test_checkpointed_regions_and_custom_functions():
    x = torch.randn(5, requires_grad=True)

    def forward():
        a = checkpoint(_region, x, use_reentrant=False)  # L:ckpt-nonreentrant
        b = checkpoint(_region, a, use_reentrant=True)  # L:ckpt-reentrant
        c = ScaleF.apply(b)  # L:custom-apply
        return c.sum()  # L:ckpt-sum

    report, truth, _ = traced(forward)
    names = by_name(report)
    # non-reentrant: the region's own ops run in forward and keep the lines inside the region
    assert names["TanhBackward0"] == {line("region-tanh")}
    assert names["MulBackward0"] == {line("region-mul")}
    # reentrant: one node for the region, made where checkpoint() was called; a custom Function: apply's line
    assert names["CheckpointFunctionBackward"] == {line("ckpt-reentrant")}
    assert names["ScaleFBackward"] == {line("custom-apply")}
    assert names["SumBackward0"] == {line("ckpt-sum")}
    assert_matches_torch(report, truth)


def test_a_transformer_from_transformers_matches_torchs_own_record():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=50)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 50, (1, 8))
    report, truth, _ = traced(lambda: model(ids, labels=ids).loss, model)
    assert assert_matches_torch(report, truth) > 50
    files = {d["location"].split(":")[0] for _, d in report.graph.nodes(data=True) if d.get("location")}
    assert "modeling_gpt2.py" in files


def test_a_gradscope_mode_between_the_user_and_the_op_is_skipped():
    x = torch.randn(2, 4, device="meta", requires_grad=True)

    def forward():
        with gradscope.memory.cpu_kernels_on_meta():  # a TorchFunctionMode of gradscope's own
            return x.sin().sum()  # L:meta-mode

    report, truth, _ = traced(forward)
    assert by_name(report)["SinBackward0"] == {line("meta-mode")}
    assert_matches_torch(report, truth)


def test_nested_traces_both_record_the_lines():
    x = torch.randn(3, requires_grad=True)
    with gradscope.trace() as outer:
        with gradscope.trace() as inner:
            loss = _user_fn(x)
    for tr in (outer, inner):
        names = by_name(gradscope.inspect(loss, trace=tr))
        assert names["SinBackward0"] == {line("user-sin")}


def test_nodes_made_outside_the_block_have_no_line():
    x = torch.randn(3, requires_grad=True)
    before = x.exp()  # L:outside
    with gradscope.trace() as tr:
        loss = (before * 3).sum()  # L:inside
    names = by_name(gradscope.inspect(loss, trace=tr))
    assert names["ExpBackward0"] == {None}
    assert names["MulBackward0"] == names["SumBackward0"] == {line("inside")}


# -- what the user sees ----------------------------------------------------------------------------
class Wide(Linears):
    LAYERS = {"up": (64, 512), "down": (512, 1)}

    def forward(self, x):
        h = torch.tanh(self.up(x))  # L:wide-up
        return self.down(h).sum()  # L:wide-down


def test_the_peak_nodes_line_in_print_bm():
    torch.manual_seed(0)
    model = Wide()
    x = torch.randn(256, 64)
    report, truth, loss = traced(lambda: model(x), model)
    bm = report.backward_memory()
    seq = report.graph.nodes[bm.peak_node]["seq"]
    assert bm.peak_location == truth[seq] and bm.peak_location in (line("wide-up"), line("wide-down"))
    assert f"({bm.peak_location})" in str(bm).splitlines()[0]
    summary = report.summary()
    assert f"({line('wide-up')})" in summary  # the top saved-memory nodes carry their lines too


_TARGET = """
import torch
from torch import nn

def step():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 1))
    y = m(torch.randn(128, 64))
    return y.pow(2).mean(), m
"""


def test_cli_memory_prints_the_peak_nodes_line(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADSCOPE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(_TARGET))
    res = CliRunner().invoke(main, ["memory", f"{path}:step"])
    assert res.exit_code == 0, res.output
    head = next(t for t in res.output.splitlines() if t.startswith("backward() memory"))
    lines = path.read_text().splitlines()
    made = {f"train.py:{i + 1}" for i, t in enumerate(lines) if "m(torch.randn" in t or "pow(2)" in t}
    assert any(f"({m})" in head for m in made), head
    plain = CliRunner().invoke(main, ["memory", f"{path}:step", "--no-trace"])
    assert "train.py:" not in plain.output  # no trace, no line


def test_the_rendered_svg_and_html_viewer_carry_the_line(tmp_path):
    pytest.importorskip("graphviz")
    import shutil

    if shutil.which("dot") is None:
        pytest.skip("Graphviz 'dot' is not installed")
    x = torch.randn(4, requires_grad=True)
    with gradscope.trace() as tr:
        loss = _user_fn(x)
    report = gradscope.inspect(loss, trace=tr)
    sin = next(n for n, d in report.graph.nodes(data=True) if d["name"] == "SinBackward0")
    svg = Path(report.render(tmp_path / "g.svg")).read_text()
    assert f'xlink:title="{sin} SinBackward0 at {line("user-sin")}"' in svg  # the node's tooltip
    page = Path(report.render(tmp_path / "g.html")).read_text()
    assert f'"location": "{line("user-sin")}"' in page or f'"location":"{line("user-sin")}"' in page
    untraced = gradscope.inspect(_user_fn(x))
    assert "xlink:title" not in Path(untraced.render(tmp_path / "u.svg")).read_text()


def test_a_finding_about_a_node_names_its_line():
    w = torch.randn(3, 3, requires_grad=True)
    with gradscope.trace() as tr:
        out = w @ w  # L:non-scalar
    (finding,) = [f for f in gradscope.inspect(out, trace=tr).findings if f.kind == "non-scalar-root"]
    assert finding.location == line("non-scalar") and f"[{line('non-scalar')}]" in str(finding)
    (plain,) = [f for f in gradscope.inspect(out).findings if f.kind == "non-scalar-root"]
    assert plain.location is None


def test_a_freed_graph_finding_names_the_line_of_its_first_node():
    w = torch.randn(3, 3, requires_grad=True)
    with gradscope.trace() as tr:
        loss = (w @ w).sum()  # L:freed
    loss.backward()
    (finding,) = [f for f in gradscope.inspect(loss, trace=tr).findings if f.kind == "freed-graph"]
    assert finding.location == line("freed")
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()  # torch agrees the graph is freed


def test_the_line_survives_a_json_round_trip_and_a_bad_one_is_refused(tmp_path):
    x = torch.randn(4, requires_grad=True)
    with gradscope.trace() as tr:
        loss = _user_fn(x)
    report = gradscope.inspect(loss, trace=tr)
    path = report.render(tmp_path / "r.json")
    assert by_name(gradscope.load(path))["SinBackward0"] == {line("user-sin")}
    text = Path(path).read_text().replace(f'"{line("user-sin")}"', "12", 1)
    Path(path).write_text(text)
    with pytest.raises(gradscope.InputValueError, match="location"):
        gradscope.load(path)


# -- no harm, small cost -----------------------------------------------------------------------------
def test_no_frame_or_tensor_outlives_the_forward():
    refs = []

    def forward(x):
        local = torch.randn(64)  # only this frame holds it
        refs.append(weakref.ref(local))
        return (x.sin() * local.sum()).sum()

    x = torch.randn(4, requires_grad=True)
    with gradscope.trace() as tr:
        loss = forward(x)
    report = gradscope.inspect(loss, trace=tr)
    assert refs[0]() is None  # the frame died with its call: nobody kept it
    frames = [o for o in gc.get_objects() if type(o) is types.FrameType and o.f_code is forward.__code__]
    assert frames == []
    kept = tr.node_lines
    assert all(type(v) in (str, type(None)) for v in kept.lines) and type(kept.end) is int
    assert all(type(d.get("location", "")) is str for _, d in report.graph.nodes(data=True))


def test_untraced_nodes_have_no_location():
    x = torch.randn(4, requires_grad=True)
    report = gradscope.inspect(_user_fn(x))
    assert all("location" not in d for _, d in report.graph.nodes(data=True))


def test_a_loop_on_one_line_costs_one_segment():
    x = torch.randn(2, requires_grad=True)
    with gradscope.trace() as tr:
        y = x
        for _ in range(500):
            y = y * 1.001  # L:loop
    assert by_name(gradscope.inspect(y.sum(), trace=tr))["MulBackward0"] == {line("loop")}
    assert len(tr.node_lines.starts) <= 2  # the loop, then the sum: one entry per change of line


def test_the_program_runs_as_without_the_trace():
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(3, 8)
    ref = net(x)
    ref.backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    with gradscope.trace(net):
        out = net(x)
    assert torch.equal(out, ref.detach()) and out.grad_fn._sequence_nr() >= 0
    out.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), grads))
    assert sys.getrefcount(x) == 2  # x itself and the getrefcount argument: nothing else holds it
