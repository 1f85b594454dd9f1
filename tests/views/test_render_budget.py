"""The default picture is bounded (NOTE [layout budget]) and drawn even when Graphviz crashes (NOTE [dot
crashes]): counted layouts, not time; pictures checked as pictures (size, what is drawn, the caption).

Ground truth for the planted detach: torch's backward leaves the cut block's parameters without a
gradient; for the crash: the installed ``dot`` run on the drawing's DOT is killed by a signal.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import shutil
import stat
import subprocess

import pytest
import torch
from torch import nn

import gradscope
from gradscope.errors import RenderError
from gradscope.views import drawing as drawing_module
from gradscope.views.engine import layout
from gradscope.views.engine.layout import RANK_LR, RANK_TB, estimate
from gradscope.views.fit import draw_with, legible, svg_size
from gradscope.views.options import RenderOptions
from tests._dense_models import random_dag
from tests._fold_models import DenseNet, loss_of

pytestmark = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' is not installed")


@pytest.fixture
def layouts(monkeypatch):
    """Every Graphviz run of a render: (the DOT source, its engine)."""
    runs: list = []
    real = drawing_module.pipe

    def counted(dot, fmt, timeout=None):
        runs.append((dot.source, dot.engine))
        return real(dot, fmt, timeout)

    monkeypatch.setattr(drawing_module, "pipe", counted)
    return runs


def _dag(*args):
    loss, model = random_dag(*args)
    return gradscope.inspect(loss, model=model)


def _svg_text(svg: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", " ", svg.replace("&#160;", " ")).split())


@functools.cache
def _dense_with_cut(where: str = "features.denseblock3.denselayer10"):
    """One traced DenseNet-121-like forward with a cut, shared by the tests (they only draw it)."""
    model = DenseNet()  # DenseNet-121's blocks (6, 12, 24, 16), small widths
    with gradscope.trace() as tr:
        loss = loss_of(model, 32, detach_at=where)
    report = gradscope.inspect(loss, model=model, trace=tr)
    loss.backward()
    dead = {n for n, p in model.named_parameters() if p.grad is None}
    return report, dead


def test_densenet121_like_with_a_cut_is_drawn_in_few_layouts(layouts, tmp_path):
    report, dead = _dense_with_cut()
    assert dead == {n for n, _ in DenseNet().named_parameters() if n.startswith("features.denseblock3.denselayer10.")}
    svg = pathlib.Path(report.render(tmp_path / "g.svg")).read_text(encoding="utf-8")
    # every dense layer reads all earlier ones: one box per layer of block 3 would be 300 edges over 24
    # ranks; the search lays out a handful of candidates at most, none of them that one
    assert 1 <= len(layouts) <= 3, len(layouts)
    assert all(src.count("->") < 200 for src, _ in layouts), [src.count("->") for src, _ in layouts]
    assert legible(*svg_size(svg)) is None, svg_size(svg)
    text = _svg_text(svg)
    assert 'id="cluster:features.denseblock3"' in svg  # the block of the cut is open ...
    assert "denselayer1 \u2013 denselayer9 (collapsed)" in text  # ... its other layers in runs of calls
    assert "denselayer12 \u2013 denselayer24 (collapsed)" in text
    assert "CUT: detach" in text and "gs-cut" in svg.replace("&#45;", "-")
    drawn = set(re.findall(r">features\.denseblock3\.denselayer10\.([\w.]+)<", svg))
    assert {f"features.denseblock3.denselayer10.{x}" for x in drawn} == dead  # the params cut off, by name


def test_estimate_is_a_lower_bound_of_the_laid_out_size(tmp_path):
    for report in (_dense_with_cut()[0], _dag(12, 2, 3)):
        d = drawing_module.drawing(report)
        est = estimate(report.graph, d.view, 1)
        rankdir = "LR" if 'rankdir=LR' in d.dot.source else "TB"
        along = d.size[1] if rankdir == "TB" else d.size[0]
        per = RANK_TB if rankdir == "TB" else RANK_LR
        if "Wrapped into" not in d.dot.source:
            assert along >= est.ranks * per - (per - RANK_TB / 2), (along, est)


def test_a_search_out_of_budget_says_so_and_shows_the_best_so_far(layouts, monkeypatch, tmp_path):
    monkeypatch.setattr(layout, "MAX_LAYOUTS", 1)
    report = _skip_report()  # two tall halves: the first layout is too tall for its width
    svg = pathlib.Path(report.render(tmp_path / "g.svg")).read_text(encoding="utf-8")
    text = _svg_text(svg)
    assert "The layout budget (8 s, at most 1 layout) was spent after 1 layout: this is the best" in text, text[-600:]
    assert len(layouts) == 2  # the one layout of the search, then the same drawing with its caption
    assert svg_size(svg)[0] > 0


class _Half(nn.Module):
    """A scale, then linear layers of growing width (nothing repeats, so nothing folds)."""

    def __init__(self, n: int = 10):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.layers = nn.ModuleList(nn.Linear(4 + i, 5 + i) for i in range(n - 1))
        self.layers.append(nn.Linear(4 + n - 1, 4))

    def forward(self, x, skip=None):
        x = x * self.scale if skip is None else x + skip
        first = x
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x, first


class _Skip(nn.Module):
    """Two tall halves; the second starts by adding the first's first output (a skip across the page)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _Half(), _Half()

    def forward(self, x):
        h, first = self.a(x)
        return self.b(h, first)[0].sum()


def _skip_report():
    torch.manual_seed(0)
    model = _Skip()
    with gradscope.trace() as tr:
        loss = model(torch.randn(2, 4))
    return gradscope.inspect(loss, model=model, trace=tr)


def _aborts(source: str) -> bool:
    done = subprocess.run(["dot", "-Tsvg"], input=source.encode(), capture_output=True, timeout=60)
    return done.returncode < 0


def test_a_graph_that_crashes_dot_still_gets_a_picture(layouts, tmp_path):
    report = _skip_report()
    d = drawing_module.drawing(report, fold=False, layout=False)
    wrapped = draw_with(report, d.view, RenderOptions(fold=False), "TB", 2).dot.source
    if not _aborts(wrapped):
        pytest.skip(f"this Graphviz ({shutil.which('dot')}) lays the wrapped drawing out without crashing")
    # the default search wraps the tall drawing into two columns: the skip joins the columns' heads, which
    # makes Graphviz 2.43 abort (class2.c merge_chain); the retry without module clusters draws it
    d = drawing_module.drawing(report, fold=False)
    svg = d.svg
    text = _svg_text(svg)
    assert any(_aborts(src) for src, _ in layouts)  # one of the layouts tried did crash dot
    assert "Graphviz crashed laying this drawing out" in text and "drawn without module clusters" in text
    assert 'id="cluster:' not in svg  # what the caption says was dropped is gone ...
    shown = {d.element_of[n] for n in report.graph}
    assert shown and all(f'id="{e}"' in svg for e in shown)  # ... and every node is drawn, as itself or in a box
    assert legible(*svg_size(svg)) is None


def test_when_every_retry_crashes_the_error_says_what_failed(tmp_path, monkeypatch):
    folder = tmp_path / "bin"
    folder.mkdir()
    for engine in ("dot", "neato"):  # engines that abort (SIGABRT), as an assertion does
        script = folder / engine
        script.write_text("#!/bin/sh\ncat > /dev/null\necho 'boom: Assertion failed' >&2\nkill -ABRT $$\n")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")
    with pytest.raises(RenderError, match=r"Graphviz 'dot' failed to lay out the graph \(boom: Assertion failed\)"):
        _dag(4, 1, 1).render(tmp_path / "g.svg")
    assert not (tmp_path / "g.svg").exists()


@pytest.mark.parametrize("fmt", ["dot", "json", "graphml"])
def test_exports_of_a_dense_model_run_no_layout(layouts, fmt, tmp_path):
    report, _ = _dense_with_cut()
    out = pathlib.Path(report.render(tmp_path / f"g.{fmt}"))
    assert out.stat().st_size > 1000
    assert layouts == []  # no Graphviz run at all
    if fmt == "dot":
        src = out.read_text(encoding="utf-8")
        assert src == report.to_dot().source and "denselayer" in src
