"""The repeated-block fold follows module calls (NOTE [folding whole calls]).

Traced models built here with torchvision's layouts and names (tests/_fold_models.py), HF tiny GPT-2/BERT
and an unrolled LSTMCell: a fold covers whole module calls only (checked against the module names and
calls in the graph, independently of the fold's code), never two stages of different widths, says what
repeats, and never swallows the block that holds a finding. Ground truth for the planted bugs: torch's
backward (a ``.grad`` that stays None, the in-place error).
"""

from __future__ import annotations

import math
import re
import shutil
import xml.etree.ElementTree as ET

import pytest
import torch

import gradscope
from gradscope.views.collapse import build_view, infer_modules
from gradscope.views.fit import MAX_ASPECT, MIN_TEXT_PX, PAGE_PT, WINDOW_PX, legible
from gradscope.views.render import drawing
from gradscope.views.scenes import Scene, search_index
from tests._fold_models import RESNETS, DenseNet, InceptionV3, ResNet, loss_of
from tests._render_models import hf_model, lstm_gallery

pytestmark = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' is not installed")
SVG = "{http://www.w3.org/2000/svg}"


def _traced(build):
    with gradscope.trace() as tr:
        loss, model = build()
    return gradscope.inspect(loss, model=model, trace=tr), loss, model


def _folds(view) -> set:
    return {(g.cls, g.span, g.reps) for g in view.groups.values() if g.kind == "fold"}


def _ops(graph) -> list:
    ops = [(d.get("seq"), n) for n, d in graph.nodes(data=True) if d["kind"] == "op"]
    return [n for _, n in sorted(ops, key=lambda x: (math.inf if x[0] is None else x[0], x[1]))]


def _assert_whole_calls(report, view) -> None:
    """Every module call (a run of ops in one module, or a traced call) is inside a fold, outside it, or
    holds all of it: a fold never covers the tail of one call and the head of the next."""
    graph, order = report.graph, _ops(report.graph)
    module_of = infer_modules(graph)
    runs = []
    for k in range(1, 1 + max((m.count(".") + 1 for m in module_of.values() if m), default=0)):
        prev, start = None, 0
        for i, n in enumerate(order + [None]):
            m = module_of.get(n) if n is not None else None
            key = ".".join(m.split(".")[:k]) if m and m.count(".") + 1 >= k else None
            if key != prev:
                if prev is not None:
                    runs.append(set(order[start:i]))
                prev, start = key, i
    seq = {n: graph.nodes[n]["seq"] for n in order}
    for _name, _parent, _cls, first, end in graph.graph.get("module_calls", ()):
        runs.append({n for n in order if first <= seq[n] < end})
    for g in view.groups.values():
        if g.kind != "fold":
            continue
        ops = {n for n in g.members if graph.nodes[n]["kind"] == "op"}
        for run in runs:
            assert not (run & ops) or run <= ops or ops <= run, (g.title, g.span, sorted(run - ops)[:3])


def _svg_texts(svg: str) -> str:
    root = ET.fromstring(svg)
    return "\n".join(" ".join("".join(t.itertext()).split()) for t in root.iter(f"{SVG}text"))


EXPECTED = {  # the stages' repeated blocks: whole blocks, one stage each (the first block has a downsample)
    "resnet18": {("BasicBlock", ("layer1.0", "layer1.1"), 2)},
    "resnet34": {("BasicBlock", ("layer1.0", "layer1.2"), 3), ("BasicBlock", ("layer2.1", "layer2.3"), 3),
                 ("BasicBlock", ("layer3.1", "layer3.5"), 5), ("BasicBlock", ("layer4.1", "layer4.2"), 2)},
    "resnet50": {("Bottleneck", ("layer1.1", "layer1.2"), 2), ("Bottleneck", ("layer2.1", "layer2.3"), 3),
                 ("Bottleneck", ("layer3.1", "layer3.5"), 5), ("Bottleneck", ("layer4.1", "layer4.2"), 2)},
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_resnet_folds_whole_blocks_of_one_stage(name):
    model = ResNet(**RESNETS[name])
    report, _, _ = _traced(lambda: (loss_of(model), model))
    assert _folds(build_view(report.graph, report.findings)) == EXPECTED[name]
    d = drawing(report)                                   # the default drawing
    assert legible(*d.size) is None, d.size
    _assert_whole_calls(report, d.view)
    text = _svg_texts(d.svg)
    for stage in ("layer1", "layer2", "layer3", "layer4"):  # every stage named, as a cluster or a box
        assert re.search(rf"^{stage}\b", text, re.M), stage
    for cls, (first, last), reps in _folds(d.view):
        assert f"x{reps} {cls} ({first} \u2013 {last})" in text
        assert first.split(".")[0] == last.split(".")[0]  # never two stages (their widths differ)


def test_densenet_stages_are_named_and_no_fold_merges_layers_of_different_widths():
    model = DenseNet()
    report, _, _ = _traced(lambda: (loss_of(model), model))
    d = drawing(report)
    assert legible(*d.size) is None, d.size
    _assert_whole_calls(report, d.view)
    text = _svg_texts(d.svg)
    for stage in ["denseblock1", "denseblock2", "denseblock3", "denseblock4", "transition1", "transition3"]:
        assert re.search(rf"\b{stage}\b", text), stage
    # each dense layer reads all earlier features: its input (and conv1's weight) grows, so none repeats
    assert not [g for g in build_view(report.graph, report.findings).groups.values() if g.kind == "fold"]


@pytest.mark.parametrize("where", ["layer2.0.downsample", "layer3.2.conv2", "layer1.1.conv1"])
def test_a_cut_keeps_its_block_open_with_the_octagon_by_its_op(where):
    model = ResNet(**RESNETS["resnet50"])
    report, loss, _ = _traced(lambda: (loss_of(model, detach_at=where), model))
    loss.backward()                                       # torch: the cut module's weights get no gradient
    dead = {n for n, p in model.named_parameters() if p.grad is None}
    assert f"{where}.0.weight" in dead if where.endswith("downsample") else f"{where}.weight" in dead
    [finding] = [f for f in report.findings if f.kind == "detached-branch"]
    assert set(finding.params) <= dead and finding.location.startswith("_fold_models.py:")
    block = ".".join(where.split(".")[:2])                # "layer2.0"
    d = drawing(report)
    assert legible(*d.size) is None, d.size
    _assert_whole_calls(report, d.view)
    for g in d.view.groups.values():                      # the block is open: none of its ops folded
        if g.kind == "fold":
            assert not any((d.view.module_of.get(n) or "").startswith(block + ".") for n in g.members), g.span
            assert block not in g.span
    cut = next(e for e, info in d.elements.items() if info["kind"] == "cut")
    [site] = [b for (a, b) in _edges(d) if a == cut and d.elements[b]["kind"] == "op"]
    assert d.element_of[site] == site and d.view.module_of[site].startswith(block)   # drawn as itself
    boxes = _boxes(d.svg)
    (cx, cy), (ox, oy) = boxes[cut], boxes[site]
    assert abs(cy - oy) < 120 and abs(cx - ox) < 300, (boxes[cut], boxes[site])  # next to its op
    top = Scene("top", "model", None, d.svg, d, list(report.graph.nodes))
    rows = {r[0]: r for r in search_index(report, [top])["nodes"]}
    assert rows[site][3] == 0 and rows[site][4] == 1      # search finds the op drawn in the top picture


def _edges(d) -> list:
    """(element id, element id) of every edge in the drawing's DOT source."""
    src = d.dot.source
    ids = dict(re.findall(r'^\t+(\S+) \[.*\bid="?([^"\s]+)"?', src, re.M))
    return [(ids.get(a, a), ids.get(b, b)) for a, b in re.findall(r"^\t+(\S+) -> (\S+)", src, re.M)]


def _boxes(svg: str) -> dict:
    """SVG element id -> the centre (x, y) of its shape."""
    out = {}
    for g in ET.fromstring(svg).iter(f"{SVG}g"):
        shape = next((s for s in g.iter() if s.tag in (f"{SVG}polygon", f"{SVG}path", f"{SVG}ellipse")), None)
        if g.get("id") and shape is not None and shape.get("points"):
            pts = [tuple(map(float, p.split(","))) for p in shape.get("points").split()]
            out[g.get("id")] = (sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts))
        elif g.get("id") and shape is not None and shape.get("d"):
            nums = [tuple(map(float, p.split(","))) for p in re.findall(r"-?[\d.]+,-?[\d.]+", shape.get("d"))]
            out[g.get("id")] = (sum(p[0] for p in nums) / len(nums), sum(p[1] for p in nums) / len(nums))
    return out


@pytest.mark.parametrize("kind,cls,blocks", [("gpt2", "GPT2Block", "transformer.h"),
                                             ("bert", "BertLayer", "bert.encoder.layer")])
def test_transformer_layers_fold_and_the_layer_with_a_finding_stays_open(kind, cls, blocks):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    report, _, _ = _traced(lambda: hf_model(kind, 4))
    d = drawing(report)
    assert legible(*d.size) is None, d.size
    assert _folds(d.view) == {(cls, (f"{blocks}.0", f"{blocks}.3"), 4)}
    assert f"x4 {cls} ({blocks}.0 \u2013 {blocks}.3)" in _svg_texts(d.svg)
    torch.manual_seed(0)
    report, loss, _ = _traced(lambda: hf_model(kind, 4, planted=True))    # a hazard planted in layer 2
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward(retain_graph=True)
    [hazard] = [f for f in report.findings if f.kind == "inplace-hazard"]
    d = drawing(report)
    assert legible(*d.size) is None, d.size
    _assert_whole_calls(report, d.view)
    assert _folds(d.view) == {(cls, (f"{blocks}.0", f"{blocks}.1"), 2)}     # layer 2 open, layer 3 alone
    assert d.element_of[hazard.node] == hazard.node


def test_an_unrolled_cell_folds_call_by_call():
    report, _, _ = _traced(lambda: lstm_gallery(200))
    d = drawing(report)
    assert legible(*d.size) is None
    assert _folds(d.view) == {("LSTMCell", ("cell", "cell"), 200)}
    assert "x200 LSTMCell (cell, calls 1\u2013200)" in _svg_texts(d.svg)
    report, loss, _ = _traced(lambda: lstm_gallery(200, planted=True))    # a hazard after step 100
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    [hazard] = [f for f in report.findings if f.kind == "inplace-hazard"]
    d = drawing(report)
    _assert_whole_calls(report, d.view)
    assert _folds(d.view) == {("LSTMCell", ("cell", "cell"), 101), ("LSTMCell", ("cell", "cell"), 99)}
    assert d.element_of[hazard.node] == hazard.node
    text = _svg_texts(d.svg)
    assert "(cell, calls 1\u2013101)" in text and "(cell, calls 102\u2013200)" in text


@pytest.mark.parametrize("name", ["resnet50", "lstm"])
def test_untraced_folds_stay_inside_inferred_modules(name):
    if name == "lstm":
        loss, model = lstm_gallery(200)
    else:
        model = ResNet(**RESNETS[name])
        loss = loss_of(model)
    report = gradscope.inspect(loss, model=model)
    view = build_view(report.graph, report.findings)
    assert any(g.kind == "fold" for g in view.groups.values())
    _assert_whole_calls(report, view)
    d = drawing(report)
    assert legible(*d.size) is None, d.size
    _assert_whole_calls(report, d.view)


@pytest.mark.parametrize("traced", [False, True], ids=["plain", "traced"])
@pytest.mark.parametrize("planted", [None, "Mixed_6e.branch_pool"])
def test_inception_default_drawing_keeps_the_page_rule(traced, planted, tmp_path):
    """Eleven blocks of four parallel branches: a tall, thin chain that no fold shortens (the blocks differ
    in widths) is wrapped into columns; measured on the SVG render() writes."""
    model = InceptionV3()
    if traced:
        report, loss, _ = _traced(lambda: (loss_of(model, size=75, detach_at=planted), model))
    else:
        loss = loss_of(model, size=75, detach_at=planted)
        report = gradscope.inspect(loss, model=model)
    root = ET.parse(report.render(tmp_path / "g.svg")).getroot()
    width, height = (float(root.get(k).removesuffix("pt")) for k in ("width", "height"))
    assert max(width, height) <= PAGE_PT and max(width, height) <= MAX_ASPECT * min(width, height), (width, height)
    scale = min(1.0, WINDOW_PX / (width * 4 / 3))            # the page fit to a 1,600 px window
    marked = [g for g in root.iter(f"{SVG}g") if "gs-finding" in g.get("class", "")]
    if planted:
        loss.backward()                                       # torch: the cut branch gets no gradient
        assert model.get_submodule(planted).conv.weight.grad is None
        assert marked and any("CUT" in "".join(g.itertext()) for g in marked) == traced
    for g in marked:
        for t in g.iter(f"{SVG}text"):
            assert float(t.get("font-size")) * 4 / 3 * scale >= MIN_TEXT_PX
