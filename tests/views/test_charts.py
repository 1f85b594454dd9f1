"""The SVG charts (backward curve, what-if, plan, gradient flow): ``to_svg(path)`` returns the path as
``render(path)`` does, ``to_svg()`` the text; a caption is never wider than its picture."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
import torch
from torch import nn

import gradscope
from gradscope.errors import RenderError
from gradscope.watching.flowchart import CHAR_PX

SVG = "{http://www.w3.org/2000/svg}"


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _guard():
    model = _model()
    with gradscope.watch(model) as guard:
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
    return guard


def charts():
    """name -> (the object's to_svg / flow_svg method)."""
    model = _model()
    with gradscope.trace(model) as tr:
        loss = model(torch.randn(4, 8)).pow(2).mean()
    report = gradscope.inspect(loss, model=model, trace=tr)
    return {
        "backward_memory": report.backward_memory().to_svg,
        "what_if": report.what_if(checkpoint=["2"]).to_svg,
        "plan": report.plan(budget=1).to_svg,
        "flow": _guard().flow_svg,
    }


@pytest.fixture(scope="module")
def all_charts():
    return charts()


@pytest.mark.parametrize("name", ["backward_memory", "what_if", "plan", "flow"])
def test_to_svg_returns_the_path_when_given_one_and_the_text_without(all_charts, name, tmp_path):
    to_svg = all_charts[name]
    text = to_svg()
    assert text.lstrip().startswith("<svg") and ET.fromstring(text).tag == SVG + "svg"
    for path in (tmp_path / f"{name}.svg", str(tmp_path / f"{name}2.svg")):
        out = to_svg(path)
        assert out == str(path) and isinstance(out, str)
        assert open(out, encoding="utf-8").read() == text
    with pytest.raises(RenderError, match=r"cannot write .*: No such file or directory"):
        to_svg(tmp_path / "no" / "such" / "folder.svg")


def test_flow_caption_fits_the_picture_width(all_charts):
    """Each line of text is at most as wide as the picture at CHAR_PX per character (the browser test in
    test_html_browser.py measures real glyphs), for a narrow picture of 3 steps and 5 modules."""
    root = ET.fromstring(all_charts["flow"]())
    width = float(root.get("width"))
    texts = list(root.iter(SVG + "text"))
    caption = [t for t in texts if "gradient L2 norm" in "".join(t.itertext())]
    assert caption, "the flow picture has its caption"
    for t in texts:
        line, x = "".join(t.itertext()), float(t.get("x"))
        left, right = (x - CHAR_PX * len(line), x) if t.get("text-anchor") == "end" else (x, x + CHAR_PX * len(line))
        assert 0 <= left and right <= width, (line, left, right, width)
