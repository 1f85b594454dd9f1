"""The HTML page and the notebook display: self-contained, ids that the script can find, never raising."""

from __future__ import annotations

import json
import re
import shutil
import xml.etree.ElementTree as ET

import pytest

import gradscope
from gradscope.views.notebook import repr_html, repr_mimebundle
from tests._render_models import planted

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' is not installed")


@pytest.fixture
def report():
    loss, model = planted()
    return gradscope.inspect(loss, model=model)


def _data(text: str) -> dict:
    blob = re.search(r'<script type="application/json" class="gs-data">(.*?)</script>', text, re.S).group(1)
    return json.loads(blob)


@needs_dot
def test_html_page_is_self_contained(report, tmp_path):
    text = open(report.render(tmp_path / "g.html"), encoding="utf-8").read()
    assert text.startswith("<!DOCTYPE html>")
    svg = text[text.index("<svg"):text.index("</svg>") + 6]
    ET.fromstring(svg)                                   # the inline SVG is well-formed XML
    # no network: no external scripts, styles, images or fonts (SVG/XLink namespaces are not fetched)
    urls = set(re.findall(r"https?://[^\s\"'<>)]+", text))
    assert urls <= {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|@import|url\(", text)


@needs_dot
def test_html_findings_point_at_drawn_elements(report, tmp_path):
    text = open(report.render(tmp_path / "g.html"), encoding="utf-8").read()
    data = _data(text)
    ids = set(re.findall(r'<g id="([^"]+)" class="node', text))
    assert len(data["findings"]) == len(report.findings)
    for f, d in zip(report.findings, data["findings"]):
        assert d["kind"] == f.kind and d["targets"], f
        assert set(d["targets"]) <= ids
        if f.node is not None:
            assert f.node in d["targets"]
    for eid in ids:                                      # every node has details for hover/click
        assert eid in data["elements"]
    hazard = next(f.node for f in report.findings if f.kind == "inplace-hazard")
    assert any("STALE" in line for line in data["elements"][hazard]["saved"])


@needs_dot
def test_notebook_display_has_table_then_graph(report):
    out = repr_html(report)
    assert out.index('<table class="gs-table">') < out.index("<svg")
    assert "inplace-hazard" in out and "unused-parameter" in out
    bundle = repr_mimebundle(report)
    assert set(bundle) == {"text/plain", "text/html", "image/svg+xml"}
    ET.fromstring(bundle["image/svg+xml"])
    only = repr_mimebundle(report, include={"image/svg+xml"})
    assert set(only) == {"image/svg+xml"}
    assert "text/html" not in repr_mimebundle(report, exclude={"text/html"})
    assert report._repr_html_().startswith("<p><b>gradscope</b>")


def test_notebook_display_without_dot_falls_back_to_the_table(report, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))            # no 'dot' on PATH
    out = repr_html(report)
    assert "inplace-hazard" in out and "<svg" not in out and "apt-get install graphviz" in out
    bundle = repr_mimebundle(report)
    assert "image/svg+xml" not in bundle and "<table" in bundle["text/html"]
