"""A compiled region in the picture: a module box named after the compiled module, holding the ops of
its backward graph (from ``bw_module``), its inputs and saved tensors; boxed and opened like any module.

The ops drawn are the backward graph's own (``torch.fx`` nodes read with ``bw_module.graph``, compared
here against the graph torch keeps), never a single ``CompiledFunctionBackward`` node.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest
import torch

import gradscope
from gradscope.views.regions import with_regions
from gradscope.views.render import drawing
from tests.compiled import _models as M

HAS_DOT = shutil.which("dot") is not None


def _compiled(cls, **kw):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = cls(**kw)
    compiled = torch.compile(model, backend="aot_eager")
    loss = compiled(M.example(model))
    report = gradscope.inspect(loss, model=compiled)
    gm = type(loss.grad_fn)._forward_cls._lazy_backward_info.bw_module
    ops = {str(n.target).split(".")[1] for n in gm.graph.nodes if n.op == "call_function" and "aten" in str(n.target)}
    return report, ops


@pytest.fixture(scope="module")
def mlp():
    yield _compiled(M.MLP)
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def conv():
    yield _compiled(M.ConvNet, graph_break=True)
    torch._dynamo.reset()


def test_the_region_is_a_box_named_after_the_module_with_its_backward_ops(mlp):
    report, torch_ops = mlp
    d = drawing(report, layout=False)
    src = d.dot.source
    assert 'label="MLP (compiled)"' in src and "_orig_mod" not in src
    drawn = {e["op"] for e in d.elements.values() if e["kind"] == "op" and e["module"].startswith("MLP (compiled)")}
    assert {"mm", "threshold_backward", "t"} <= drawn and {op for op in drawn if "." not in op} <= torch_ops | {
        "CompiledFunctionBackward"}
    assert any(e["module"] == "MLP (compiled).fc1" for e in d.elements.values())  # the model's modules nest
    region = next(e for e in d.elements.values() if e.get("op") == "CompiledFunctionBackward")
    assert region["module"] == "MLP (compiled)" and region["saved"]  # the region's saved tensors
    g = with_regions(report).graph  # the input feeds the op that makes its gradient, in its module's box
    (weight,) = [n for n, name in g.nodes(data="name") if name == "fc1.weight"]
    assert [(g.nodes[v]["name"], g.nodes[v]["module"]) for v in g.successors(weight)] == [("t", "MLP (compiled).fc1")]


def test_the_region_boxes_and_opens_like_a_module(mlp):
    report, _ = mlp
    top = drawing(report, collapse=0, layout=False)
    assert list(top.view.groups) == ["module:MLP (compiled)"]
    inside = drawing(report, box="module:MLP (compiled)", within=top, layout=False)
    names = {e.get("op") or e["name"] for e in inside.elements.values()}
    assert {"mm", "threshold_backward", "fc1.weight", "fc3.weight", "CompiledFunctionBackward"} <= names


def test_a_graph_break_makes_two_boxes_the_second_named_after_the_break(conv):
    report, _ = conv
    top = drawing(report, collapse=0, layout=False)
    assert sorted(top.view.groups) == ["module:ConvNet (compiled)",
                                       "module:ConvNet (compiled, after the graph break at line 59)"]
    src = open(M.__file__).read().splitlines()
    assert "graph_break()" in src[59 - 1]
    second = drawing(report, box="module:ConvNet (compiled, after the graph break at line 59)", within=top,
                     layout=False)
    assert {"convolution_backward", "native_batch_norm_backward", "conv2.weight", "skip.weight"} - {
        e.get("op") or e["name"] for e in second.elements.values()} == {"skip.weight"}  # .data cut skip


def test_a_report_loaded_from_json_draws_the_same_box(mlp):
    report, _ = mlp
    loaded = gradscope.Report.from_json(report.to_json())
    assert drawing(loaded, layout=False).dot.source == drawing(report, layout=False).dot.source


@pytest.mark.skipif(not HAS_DOT, reason="Graphviz 'dot' is not installed")
def test_the_svg_shows_the_box_and_the_ops(mlp, tmp_path):
    report, _ = mlp
    svg = open(report.render(tmp_path / "g.svg")).read()
    assert ">MLP (compiled)<" in svg and ">threshold_backward<" in svg and "_orig_mod" not in svg


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.mark.browser
@pytest.mark.skipif(not (CHROMIUM and DRIVER and HAS_DOT), reason="chromium, chromedriver and dot are needed")
def test_the_viewer_opens_the_region_box_and_goes_back(mlp, tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    report, _ = mlp
    path = report.render(tmp_path / "g.html", collapse=0)
    profile = tempfile.mkdtemp(prefix="gradscope-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        driver.get(f"file://{path}")
        scene = lambda: driver.execute_script("return document.querySelector('.gs-view').dataset.scene")  # noqa: E731
        box = driver.find_element(By.CSS_SELECTOR, '.gs-scene:not([hidden]) g[id="module:MLP (compiled)"]')
        box.click()
        end = time.monotonic() + 5
        while scene() == "top" and time.monotonic() < end:
            time.sleep(0.05)
        assert scene() == "module:MLP (compiled)"
        ops = driver.find_elements(By.CSS_SELECTOR, ".gs-scene:not([hidden]) g.gs-op")
        shown = {g.text.split("\n")[0] for g in ops}
        assert {"mm", "threshold_backward"} <= shown, shown
        ActionChains(driver).send_keys(Keys.ESCAPE).perform()
        end = time.monotonic() + 5
        while scene() != "top" and time.monotonic() < end:
            time.sleep(0.05)
        assert scene() == "top"
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
