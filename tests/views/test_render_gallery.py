"""The gallery: the default picture of real models is legible, measured on the SVG that render() writes.

Rules (gradscope.views.fit, NOTE [fitting a page]): the longer side at most 3,000 pt, the aspect ratio at
most 4:1, every finding's node drawn as itself (not inside a folded or collapsed box) with its text at
least 10 px tall when the page is fit to a 1,600 px wide window. Ground truth for the planted findings
comes from torch: backward() raises on exactly those models.

The default run covers GPT-2 (tiny), ResNet-18 and the 200-step LSTM; ``--slow`` runs the whole gallery
(BERT, T5, ViT, a 12-layer GPT-2-small config, a 96-layer transformer, a 10k chain). Render times are
measured in bench/render_bench.py, not here.
"""

from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET

import pytest
import torch

import gradscope
from gradscope.views.fit import MAX_ASPECT, MIN_TEXT_PX, PAGE_PT, WINDOW_PX
from tests._render_models import GALLERY

pytestmark = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' is not installed")
SVG = "{http://www.w3.org/2000/svg}"
DEFAULT = ("gpt2", "resnet18", "lstm-200")
SLOW = tuple(name for name in GALLERY if name not in DEFAULT)
_CACHE: dict = {}


def _case(name: str, traced: bool, planted: bool):
    """(report, svg path, loss) for one gallery model, built once per test session."""
    key = (name, traced, planted)
    if key not in _CACHE:
        pytest.importorskip("transformers") if name in ("gpt2", "bert", "t5", "vit", "gpt2-small-12") else None
        torch.manual_seed(0)
        if traced:
            with gradscope.trace() as tr:
                loss, model = GALLERY[name](planted)
            report = gradscope.inspect(loss, model=model, trace=tr)
        else:
            loss, model = GALLERY[name](planted)
            report = gradscope.inspect(loss, model=model)
        _CACHE[key] = (report, loss)
    return _CACHE[key]


def _params(names):
    return [pytest.param(n, t, p, id=f"{n}-{'traced' if t else 'plain'}-{'planted' if p else 'clean'}",
                         marks=[pytest.mark.slow] if n in SLOW else [])
            for n in names for t in (False, True) for p in (False, True)]


def _text_px(font_pt: float, width_pt: float) -> float:
    """Height in px of ``font_pt`` text on a ``width_pt`` wide SVG shown fit to WINDOW_PX (1 pt = 4/3 px)."""
    return font_pt * 4 / 3 * min(1.0, WINDOW_PX / (width_pt * 4 / 3))


@pytest.mark.parametrize("name,traced,planted", _params(DEFAULT + SLOW))
def test_default_picture_is_legible(name, traced, planted, tmp_path):
    report, loss = _case(name, traced, planted)
    hazards = [f for f in report.findings if f.kind == "inplace-hazard"]
    if planted:                                # torch agrees that the planted bug is real
        assert hazards, [f.kind for f in report.findings]
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward(retain_graph=True)
    else:
        assert not hazards
    path = report.render(tmp_path / "g.svg")
    root = ET.parse(path).getroot()
    width, height = (float(root.get(k).removesuffix("pt")) for k in ("width", "height"))
    assert max(width, height) <= PAGE_PT, (width, height)
    assert max(width, height) <= MAX_ASPECT * min(width, height), (width, height)
    groups = {g.get("id"): g for g in root.iter(f"{SVG}g") if g.get("id")}
    for f in report.findings:
        if f.node is None:
            continue
        g = groups.get(f.node)                 # drawn as itself: its own element id, not a box's
        assert g is not None, f"{f.kind} at {f.node} is not drawn on its own in {name}"
        assert "gs-finding" in g.get("class", "")
        texts = [t for t in g.iter(f"{SVG}text")]
        assert any(re.search(r"inplace-hazard", "".join(t.itertext())) for t in texts)
        size = min(float(t.get("font-size")) for t in texts)
        assert _text_px(size, width) >= MIN_TEXT_PX, (size, width)
    # the picture draws fewer boxes than the graph has nodes on big graphs, and says how to expand
    drawn = sum(1 for g in groups.values() if "node" in g.get("class", ""))
    if report.graph.number_of_nodes() > 300:
        assert drawn < report.graph.number_of_nodes() / 3
        assert "collapse=False" in "".join(root.itertext())


def test_fully_expanded_drawing_stays_available():
    report, _ = _case("gpt2", False, True)
    full = report.to_dot(collapse=False).source
    n_ops = sum(1 for _, d in report.graph.nodes(data=True) if d["kind"] == "op")
    assert len(re.findall(r"class=\"gs-op", full)) == n_ops
    assert "gs-group" not in full


def test_a_folded_block_says_how_many_times_it_repeats(tmp_path):
    report, _ = _case("lstm-200", False, False)
    svg = open(report.render(tmp_path / "g.svg"), encoding="utf-8").read()
    reps = [int(x) for x in re.findall(r">x(\d+)(?: |&#160;)+repeated block", svg)]
    assert reps and max(reps) >= 150                 # the 200 unrolled steps, in one or two boxes
    # ... with the block's bytes: the boxes' bytes add up to what report.memory() says the cell holds
    from gradscope.views.render import drawing

    d = drawing(report)
    folds = [g for g in d.view.groups.values() if g.kind == "fold"]
    held = sum(g.saved_bytes for g in folds)
    activations = sum(r.held for r in report.memory())
    assert 0.8 * activations < held <= activations      # the steps hold nearly all activation memory
