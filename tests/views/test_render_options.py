"""render() options (rankdir, size, dpi, max_pixels), the CLI's flags and timings, and drawing(box=...)."""

from __future__ import annotations

import re
import shutil
import struct
import warnings
import xml.etree.ElementTree as ET

import pytest
import torch
from click.testing import CliRunner

import gradscope
from gradscope.cli.commands import main
from gradscope.errors import InputValueError
from gradscope.views.render import RenderWarning, drawing
from tests._render_models import lstm_gallery, planted

pytestmark = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' is not installed")
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture
def report():
    loss, model = planted()
    return gradscope.inspect(loss, model=model)


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def _svg_size(path) -> tuple[float, float]:
    root = ET.parse(path).getroot()
    return tuple(float(root.get(k).removesuffix("pt")) for k in ("width", "height"))


def test_rankdir_turns_the_layout(report, tmp_path):
    model = torch.nn.Sequential(*(torch.nn.Linear(3, 3) for _ in range(6)))
    deep = gradscope.inspect(model(torch.randn(2, 3)).sum(), model=model)
    tb = _svg_size(deep.render(tmp_path / "tb.svg", rankdir="TB"))
    lr = _svg_size(deep.render(tmp_path / "lr.svg", rankdir="lr"))
    assert tb[1] > tb[0] and lr[0] > lr[1]          # a chain: tall top-down, wide left-right
    assert "rankdir=LR" in report.to_dot(rankdir="LR").source
    with pytest.raises(InputValueError, match="rankdir must be one of TB, LR"):
        report.render(tmp_path / "x.svg", rankdir="BT?")


def test_size_scales_the_drawing_down(report, tmp_path):
    w, h = _svg_size(report.render(tmp_path / "s.svg", size=(2, 2)))
    assert max(w, h) <= 2 * 72 + 1
    big = _svg_size(report.render(tmp_path / "b.svg"))
    assert max(big) > 2 * 72
    for bad in ("wide", (1, 2, 3), -1):
        with pytest.raises(InputValueError, match="size must be"):
            report.render(tmp_path / "x.svg", size=bad)


def test_dpi_sets_the_png_resolution(report, tmp_path):
    small = _png_size(report.render(tmp_path / "a.png", dpi=36))
    large = _png_size(report.render(tmp_path / "b.png", dpi=144))
    assert 3.5 < large[0] / small[0] < 4.5


def test_a_huge_png_is_capped_with_a_warning_and_the_cap_can_be_lifted(tmp_path):
    loss, model = lstm_gallery(60)
    report = gradscope.inspect(loss, model=model)
    with pytest.warns(RenderWarning, match=r"scaled down to 400 px.*max_pixels=None"):
        out = report.render(tmp_path / "cap.png", collapse=False, max_pixels=400)
    assert max(_png_size(out)) <= 401
    with warnings.catch_warnings():
        warnings.simplefilter("error", RenderWarning)
        free = report.render(tmp_path / "free.png", collapse=False, max_pixels=None, dpi=20)
    assert max(_png_size(free)) > 400


def test_cli_layout_options_and_honest_timings(tmp_path):
    runner = CliRunner()
    out = tmp_path / "g.dot"
    res = runner.invoke(main, ["render", "tests._render_models:planted", "-o", str(out), "--rankdir", "LR",
                               "--size", "3,4"])
    assert res.exit_code == 0, res.output
    src = out.read_text()
    assert "rankdir=LR" in src and 'size="3,4"' in src
    # the target's import and forward are timed apart from gradscope's own work
    assert re.search(r"import \+ forward \d+(\.\d)? m?s, inspect \d+(\.\d)? m?s", res.stderr), res.stderr
    bad = runner.invoke(main, ["render", "tests._render_models:planted", "-o", str(out), "--size", "big"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert "--size" in bad.stderr and "size must be" in bad.stderr
    png = tmp_path / "g.png"
    res = runner.invoke(main, ["render", "tests._render_models:planted", "-o", str(png), "--max-pixels", "50"])
    assert res.exit_code == 0 and "warning:" in res.stderr and "scaled down to 50 px" in res.stderr
    assert max(_png_size(png)) <= 51


def test_drawing_of_a_folded_block_opened_shows_its_ops():
    loss, model = lstm_gallery(60)
    report = gradscope.inspect(loss, model=model)
    top = drawing(report)
    assert top.svg.startswith("<?xml") or "<svg" in top.svg[:400]
    folds = [gid for gid, g in top.view.groups.items() if g.kind == "fold"]
    assert folds and all(top.elements[gid]["expandable"] for gid in folds)
    box = top.view.groups[folds[0]]
    inner = drawing(report, box=folds[0], within=top)
    ids = {g.get("id") for g in ET.fromstring(inner.svg).iter(f"{SVG}g")}
    drawn_ops = [n for n in box.members if report.graph.nodes[n]["kind"] == "op" and n in ids
                 and not inner.elements[n]["context"]]
    assert len(drawn_ops) == len(box.pattern)          # one repetition, each op drawn as itself
    assert {report.graph.nodes[n]["name"] for n in drawn_ops} == set(box.pattern)
    classes = {g.get("id"): g.get("class", "") for g in ET.fromstring(inner.svg).iter(f"{SVG}g")}
    assert any("gs-context" in c for c in classes.values())   # the ops just outside: dashed stubs
    params = {p for e in inner.elements.values() for p in e.get("params", ())}
    assert {"cell.weight_ih", "cell.weight_hh"} <= params
    with pytest.raises(InputValueError, match="no box 'fold:nope'"):
        drawing(report, box="fold:nope", within=top)


def test_drawing_of_a_module_opened():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    report = gradscope.inspect(model(torch.randn(2, 3)).sum(), model=model)
    inner = drawing(report, box="module:2")
    ops = {e["op"] for e in inner.elements.values() if e["kind"] == "op" and not e["context"]}
    assert "AddmmBackward0" in ops
    names = {e["name"] for e in inner.elements.values() if e["kind"] == "param"}
    assert names == {"2.weight", "2.bias"}


def test_parameters_without_gradient_are_a_compact_grid_grouped_by_module(tmp_path):
    """20 frozen-out layers (a detached encoder): one box per module, in rows, not one long row."""
    class Detached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(20))
            self.head = torch.nn.Linear(4, 1)

        def forward(self, x):
            for layer in self.encoder:
                x = layer(x)
            return self.head(x.detach()).sum()

    model = Detached()
    loss = model(torch.randn(2, 4))
    report = gradscope.inspect(loss, model=model)
    loss.backward()                                       # torch: no encoder parameter gets a gradient
    assert all(p.grad is None for p in model.encoder.parameters()) and model.head.weight.grad is not None
    root = ET.parse(report.render(tmp_path / "d.svg")).getroot()
    boxes = [g for g in root.iter(f"{SVG}g") if "gs-unused" in g.get("class", "")]
    assert len(boxes) == 20                                # one per module: encoder.0 ... encoder.19
    assert any("encoder.7" in "".join(g.itertext()) and "weight, bias" in "".join(g.itertext()) for g in boxes)
    tops = [min(float(t.get("y")) for t in g.iter(f"{SVG}text")) for g in boxes]
    rows = {round(y) for y in tops}
    assert 3 <= len(rows) <= 6                             # a grid: a few rows of a few boxes each
    assert max(sum(1 for y in tops if round(y) == r) for r in rows) <= 8


def test_without_graphviz_the_dot_file_is_still_a_compact_drawing(tmp_path, monkeypatch):
    """No dot to measure layouts: the drawing is chosen by its element count instead."""
    loss, model = lstm_gallery(200, planted=True)
    report = gradscope.inspect(loss, model=model)
    monkeypatch.setenv("PATH", str(tmp_path))
    src = open(report.render(tmp_path / "g.dot"), encoding="utf-8").read()
    assert len(re.findall(r"^\t+\S+ \[label=", src, flags=re.M)) < 60 < report.graph.number_of_nodes()
    hazard = next(f for f in report.findings if f.kind == "inplace-hazard")
    assert re.search(rf'\b{hazard.node} \[label="[^"]*!! inplace-hazard', src)
