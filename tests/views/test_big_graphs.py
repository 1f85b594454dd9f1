"""Big graphs: text formats never run a layout; a layout the size of which Graphviz cannot manage is refused
before any work, with advice that names what works."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import stat

import pytest
import torch

import gradscope
from gradscope.errors import RenderError

TEXT_FORMATS = ("dot", "json", "graphml")


def _chain(n: int):
    w = torch.randn(4, requires_grad=True)
    h = w
    for _ in range(n - 2):
        h = h * 1.0001
    return gradscope.inspect(h.sum())


@pytest.fixture
def fake_dot(tmp_path, monkeypatch):
    """A ``dot`` first on PATH that records each run and fails: the marker file says whether Graphviz ran."""
    folder = tmp_path / "bin"
    folder.mkdir()
    marker = tmp_path / "dot-ran"
    script = folder / "dot"
    script.write_text(
        f"#!/bin/sh\ncat > /dev/null\necho \"$@\" >> {marker}\necho 'fake dot: no layout here' >&2\nexit 3\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")
    return marker


@pytest.mark.parametrize("collapse", [None, False])
@pytest.mark.parametrize("fmt", TEXT_FORMATS)
def test_text_formats_never_run_graphviz(fake_dot, tmp_path, fmt, collapse):
    report = _chain(600)  # over the page's element budget: the default drawing folds
    out = report.render(tmp_path / f"g.{fmt}", collapse=collapse)
    assert not fake_dot.exists(), f"writing .{fmt} ran dot: {fake_dot.read_text()}"
    text = pathlib.Path(out).read_text(encoding="utf-8")
    if fmt == "dot":
        assert text == report.to_dot(collapse=collapse).source
        assert (text.count("MulBackward0") >= 598) == (collapse is False)
    elif fmt == "json":
        assert len(json.loads(text)["nodes"]) == 600
    else:
        assert text.count("<node ") == 600
    assert not fake_dot.exists()


def test_the_fake_dot_is_what_a_layout_runs(fake_dot, tmp_path):
    """The check above can fail: a picture format does run the (fake) dot, and says how it failed."""
    with pytest.raises(RenderError, match="fake dot: no layout here"):
        _chain(50).render(tmp_path / "g.svg")
    assert fake_dot.exists()


def test_default_dot_file_says_what_it_folded(fake_dot, tmp_path):
    report = _chain(600)
    src = pathlib.Path(report.render(tmp_path / "g.dot")).read_text(encoding="utf-8")
    assert "repeated block" in src and "Drawn to fit a page: 600 nodes" in src
    assert src.count("MulBackward0") < 100


@pytest.fixture
def small_layout_limit(monkeypatch):
    """The layout limit lowered so that a 600-op chain is over it and its folded drawing is not."""
    from gradscope.views import fit

    monkeypatch.setattr(fit, "MAX_LAYOUT", 450)
    monkeypatch.setattr("gradscope.views.render.MAX_LAYOUT", 450)
    return 450


@pytest.mark.parametrize("fmt", ["svg", "png", "pdf", "html"])
def test_an_expanded_drawing_over_the_limit_is_refused_before_any_layout(fake_dot, small_layout_limit, tmp_path, fmt):
    report = _chain(600)
    with pytest.raises(RenderError) as info:
        report.render(tmp_path / f"g.{fmt}", collapse=False)
    msg = str(info.value)
    assert not fake_dot.exists(), "dot ran before the refusal"
    assert not (tmp_path / f"g.{fmt}").exists()
    assert msg.startswith(f"cannot draw 600 boxes as .{fmt}: Graphviz crashes or runs for hours above 450")
    advice = msg.split("what works:")[1]
    assert "folded default drawing" in advice and ".dot" in advice
    assert f".{fmt}" not in advice and "collapse=False" not in advice  # never what just failed
    assert msg.count(". ") == 0 and msg.endswith(".")  # one sentence
    for works in ("dot", "json", "graphml"):  # the advice holds: these write without a layout
        report.render(tmp_path / f"g.{works}", collapse=False)
    assert not fake_dot.exists()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' is not installed")
def test_the_folded_default_of_a_graph_over_the_limit_is_drawn(small_layout_limit, tmp_path):
    """What the refusal advises works: the default drawing folds the 600-op chain under the limit."""
    report = _chain(600)
    svg = pathlib.Path(report.render(tmp_path / "g.svg")).read_text(encoding="utf-8")
    assert "repeated block" in svg and svg.count("MulBackward0") < 100


def test_a_default_drawing_over_the_limit_advises_the_text_formats(fake_dot, monkeypatch, tmp_path):
    """When even the default (folded) drawing is over the limit, the advice is the formats without a layout."""
    from gradscope.views import fit
    from gradscope.views.drawing import drawing

    ops = (torch.sin, torch.cos, torch.exp, torch.tanh)
    xs = [torch.randn(2, requires_grad=True) for _ in range(300)]
    report = gradscope.inspect(torch.stack([ops[(i * i) % 4](x) for i, x in enumerate(xs)]).sum())
    boxes = fit.elements(report.graph, drawing(report, layout=False).view)
    assert boxes < 400 < report.graph.number_of_nodes()  # the default folds
    monkeypatch.setattr(fit, "MAX_LAYOUT", boxes - 1)
    monkeypatch.setattr("gradscope.views.render.MAX_LAYOUT", boxes - 1)
    with pytest.raises(RenderError) as info:
        report.render(tmp_path / "g.html")
    assert str(info.value) == (
        f"cannot draw {boxes} boxes as .html: Graphviz crashes or runs for hours above {boxes - 1}, so no layout "
        "was tried; what works: .dot, .json or .graphml (no layout needed)."
    )
    assert not fake_dot.exists()


def test_cli_refusal_is_one_line_without_traceback(fake_dot, small_layout_limit, tmp_path):
    from click.testing import CliRunner

    from gradscope.cli.commands import main

    (tmp_path / "big.py").write_text(
        "import torch\n\ndef loss():\n    h = torch.randn(4, requires_grad=True)\n"
        "    for _ in range(598):\n        h = h * 1.0001\n    return h.sum()\n"
    )
    out = tmp_path / "g.svg"
    result = CliRunner().invoke(main, ["render", f"{tmp_path / 'big.py'}:loss", "-o", str(out), "--expand"])
    assert result.exit_code != 0 and not out.exists()
    lines = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(lines) == 1 and "cannot draw 600 boxes as .svg" in lines[0], result.output
    assert "folded default drawing (without collapse= or --expand)" in lines[0]
    assert "Traceback" not in result.output


def test_render_options_are_checked_once_and_name_an_unknown_one():
    from gradscope.errors import InputTypeError
    from gradscope.views.options import RenderOptions

    report = _chain(10)
    with pytest.raises(InputTypeError, match="unknown render option 'colapse'; the options are clusters, collapse"):
        report.render("g.svg", colapse=False)
    opts = RenderOptions(rankdir="lr", size=(8, 10))
    assert (opts.rankdir, opts.size) == ("LR", "8,10")
    with pytest.raises(AttributeError):
        opts.rankdir = "TB"  # type: ignore[misc]
    assert report.to_dot(options=opts).source == report.to_dot(rankdir="LR", size="8,10").source
