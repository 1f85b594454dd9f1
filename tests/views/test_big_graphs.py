"""Big graphs: text formats never run a layout; a layout the size of which Graphviz cannot manage is refused
before any work, with advice that names what works."""

from __future__ import annotations

import json
import os
import pathlib
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
