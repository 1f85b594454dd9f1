"""The HTML page and the notebook display: self-contained, ids that the script can find, never raising."""

from __future__ import annotations

import html
import json
import re
import shutil
import xml.etree.ElementTree as ET

import pytest
import torch

import gradscope
from gradscope.views.html_page import script_json
from gradscope.views.notebook import repr_html, repr_mimebundle
from tests._render_models import planted

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' is not installed")
# The sequences that move HTML5's script-data state machine (escape, double-escape, end tag).
HOSTILE = ("<!--<script>", "</script><b>x</b>", "a-->b<script", "</SCRIPT ")


@pytest.fixture
def report():
    loss, model = planted()
    return gradscope.inspect(loss, model=model)


def _data(text: str) -> dict:
    blob = re.search(r'<script type="application/json" class="gs-data">(.*?)</script>', text, re.S).group(1)
    return json.loads(blob)


def _svgs(text: str) -> list[str]:
    return re.findall(r"<svg\b.*?</svg>", text, re.S)


@needs_dot
def test_html_page_is_self_contained(report, tmp_path):
    text = open(report.render(tmp_path / "g.html"), encoding="utf-8").read()
    assert text.startswith("<!DOCTYPE html>")
    for svg in _svgs(text):
        ET.fromstring(svg)                               # every inline SVG is well-formed XML
    # no network: no external scripts, styles, images or fonts (SVG/XLink namespaces are not fetched)
    urls = set(re.findall(r"https?://[^\s\"'<>)]+", text))
    assert urls <= {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|@import|url\(", text)
    assert "search" in text and 'data-act="in"' in text and "gs-mini" in text


@needs_dot
def test_html_findings_point_at_drawn_elements(report, tmp_path):
    text = open(report.render(tmp_path / "g.html"), encoding="utf-8").read()
    data = _data(text)
    top = data["scenes"]["top"]["elements"]
    ids = set(re.findall(r'<g id="([^"]+)" class="node', _svgs(text)[0]))
    assert len(data["findings"]) == len(report.findings)
    for f, d in zip(report.findings, data["findings"]):
        assert d["kind"] == f.kind and d["targets"], f
        assert set(d["targets"]) <= ids
        if f.node is not None:
            assert f.node in d["targets"] and f.node in d["nodes"]
    for eid in ids:                                      # every node has details for hover/click
        assert eid in top
    hazard = next(f.node for f in report.findings if f.kind == "inplace-hazard")
    assert any("STALE" in line for line in top[hazard]["saved"])


def test_script_json_has_nothing_that_html_reads_as_markup():
    data = {"names": list(HOSTILE) + ["a&b", "\u2028"]}
    text = script_json(data)
    assert not re.search(r"[<>&\u2028]", text)
    assert json.loads(text) == data                      # the same strings come back


@needs_dot
def test_hostile_parameter_names_stay_inside_the_data_block(tmp_path):
    """A name holding '<!--<script>' once swallowed the viewer's script (an HTML comment opened in a script)."""
    params = {name: torch.nn.Parameter(torch.randn(3)) for name in HOSTILE}
    loss = sum((p * (i + 2)).sum() for i, p in enumerate(params.values()))
    report = gradscope.inspect(loss, params=params)
    text = open(report.render(tmp_path / "g.html"), encoding="utf-8").read()
    blob = text[text.index('class="gs-data">') + len('class="gs-data">'):]
    blob = blob[:blob.index("</script>")]
    assert "<" not in blob and ">" not in blob
    data = json.loads(blob)
    assert set(HOSTILE) <= set(data["index"]["names"])   # still searchable, as the user spelled them
    # the page has exactly the two script elements we wrote, the second one our viewer
    assert len(re.findall(r"<script\b", text, re.I)) == 2 and text.rstrip().endswith("</html>")
    for svg in _svgs(text):
        ET.fromstring(svg)


@needs_dot
def test_notebook_display_lists_each_finding_once(report):
    out = repr_html(report)
    assert "<table" not in out                           # one list, not a table plus the same list
    for i, f in enumerate(report.findings):
        assert out.count(f'id="gs-finding-{i}"') == 1
        shown = re.sub(r"<script\b.*?</script>", "", out, flags=re.S)   # what the page shows
        assert shown.count(html.escape(f.message)) == 1
    assert out.index("gs-findings") < out.index("<svg")
    assert "text-align:left" in out                      # Jupyter right-aligns rendered HTML tables
    assert 'data-auto-height="1"' in out                 # the pane takes the drawing's height
    bundle = repr_mimebundle(report)
    assert set(bundle) == {"text/plain", "text/html", "image/svg+xml"}
    ET.fromstring(bundle["image/svg+xml"])
    only = repr_mimebundle(report, include={"image/svg+xml"})
    assert set(only) == {"image/svg+xml"}
    assert "text/html" not in repr_mimebundle(report, exclude={"text/html"})
    assert report._repr_html_().startswith('<p class="gs-summary"')


def test_notebook_display_without_dot_falls_back_to_the_list(report, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))            # no 'dot' on PATH
    out = repr_html(report)
    assert "inplace-hazard" in out and "<svg" not in out and "apt-get install graphviz" in out
    bundle = repr_mimebundle(report)
    assert "image/svg+xml" not in bundle and "<ol" in bundle["text/html"]


@needs_dot
def test_every_box_opens_or_says_why_not():
    """Each box of the default drawing has its own pre-rendered drawing, until the page's budget is spent."""
    from gradscope.views.render import drawing, pipe
    from gradscope.views.scenes import scenes, search_index
    from tests._render_models import lstm

    loss, model = lstm(200)
    report = gradscope.inspect(loss, model=model)
    top = drawing(report)
    boxes = [e for e, info in top.elements.items() if info["kind"] in ("fold", "module")]
    assert boxes                                         # 200 unrolled steps: folded
    opened = scenes(report, top, lambda box, within: drawing(report, box=box, within=within), pipe)
    assert {s.sid for s in opened} >= set(boxes)
    for s in opened[1:]:
        ET.fromstring(s.svg)
        assert s.parent == "top" or s.parent in {x.sid for x in opened}
    index = search_index(report, opened)
    rows = {r[0]: r for r in index["nodes"]}
    assert set(rows) >= set(report.graph)                # every node is searchable
    # the cell parameters used by every step are in the names the search box searches
    assert "cell.weight_ih" in index["names"]

    closed = scenes(report, top, lambda box, within: drawing(report, box=box, within=within), pipe,
                    budget=(1, 10**9, 60.0))
    assert [s.sid for s in closed] == ["top"]
    assert all("budget" in top.elements[b]["closed"] for b in boxes)
    inside = [n for n, e in top.element_of.items() if e in boxes]
    index = search_index(report, closed)
    rows = {r[0]: r for r in index["nodes"]}
    # nodes inside an unopened box: their path ends at the box, and they are not drawn themselves
    assert inside and all(index["paths"][rows[n][3]][-1] in boxes and rows[n][4] == 0 for n in inside)
