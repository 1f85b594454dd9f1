"""The HTML viewer in a real headless browser: Debian's chromium driven by selenium (no browser download).

Search, drill-down into a folded block and back, finding click (zoom and highlight), keyboard zoom, the
notebook pane under Jupyter's CSS, hostile names. One browser and one small GPT-2 for the whole module.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest
import torch

import gradscope
from gradscope.checks.inplace import stale_savers
from gradscope.views.notebook import repr_html
from tests._render_models import planted

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver") if CHROMIUM and DRIVER else None

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="Debian chromium + chromedriver are not installed"),
    pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' is not installed"),
]

FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run")


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="gradscope-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_window_size(1400, 900)
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _wait(predicate, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return predicate()


READABLE_PX = 10


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A 6-layer GPT-2 (random weights, tiny sizes), traced: the default drawing folds its blocks."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=6, n_embd=32, n_head=2, n_positions=16, vocab_size=50,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 50, (1, 8))
    with gradscope.trace(model):
        loss = model(ids, labels=ids).loss
    report = gradscope.inspect(loss, model=model)
    loss.backward()
    path = report.render(tmp_path_factory.mktemp("gpt2") / "gpt2.html")
    return report, model, path


def _js(browser, script, *args):
    return browser.execute_script(script, *args)


def _scene(browser) -> str:
    return _js(browser, "return document.querySelector('.gs-view').dataset.scene")


def _scale(browser) -> float:
    return float(_js(browser, "var v=document.querySelector('.gs-view'),d=v.querySelector("
                              "'.gs-scene[data-scene=\"'+v.dataset.scene+'\"] svg');return d.dataset.gsScale"))


def _on_screen(browser, element) -> dict:
    """The element's box, whether it lies inside the canvas, and its tallest text line, in CSS px."""
    return _js(browser, """
        var g=arguments[0],c=document.querySelector('.gs-canvas').getBoundingClientRect(),r=g.getBoundingClientRect();
        var h=0;g.querySelectorAll('text').forEach(function(t){h=Math.max(h,t.getBoundingClientRect().height);});
        return {inside:r.left>=c.left-1&&r.right<=c.right+1&&r.top>=c.top-1&&r.bottom<=c.bottom+1,
                text:h,width:r.width,visible:g.getClientRects().length>0};""", element)


def _current(browser, selector):
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, f'.gs-scene:not([hidden]) {selector}')


def _search(browser, text):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = browser.find_element(By.CSS_SELECTOR, ".gs-search")
    box.clear()
    box.send_keys(text)
    box.send_keys(Keys.ENTER)
    return browser.find_element(By.CSS_SELECTOR, ".gs-count").text


def test_search_a_parameter_inside_a_folded_block(browser, gpt2):
    report, model, path = gpt2
    name = "transformer.h.0.mlp.c_fc.weight"
    assert dict(model.named_parameters())[name].grad is not None      # torch: it is in the graph
    node = next(n for n, d in report.graph.nodes(data=True) if d["kind"] == "param" and d["name"] == name)
    browser.get(f"file://{path}")
    assert _scene(browser) == "top"
    assert _js(browser, f"return document.querySelector('.gs-scene:not([hidden]) g[id=\"{node}\"]')") is None
    assert _search(browser, "h.0.mlp.c_fc.weight").startswith("1 / 1")
    assert _scene(browser) != "top"                       # the viewer opened the box that holds it
    cur = _wait(lambda: _current(browser, "g.gs-cur"))
    assert [g.get_attribute("id") for g in cur] == [node]
    seen = _on_screen(browser, cur[0])
    assert seen["inside"] and seen["text"] >= READABLE_PX, seen
    assert name in browser.find_element(By_CSS(), ".gs-details").text

    # a module that is everywhere: its parameters (named by torch) and the ops that consume them match
    params = {n for n, d in report.graph.nodes(data=True) if d["kind"] == "param" and d["name"] in
              {p for p, _ in model.named_parameters() if ".ln_1." in p}}
    consumers = {s for p in params for s in report.graph.successors(p)}
    assert len(params) == 12 and len(consumers) == 6
    assert _search(browser, "ln_1").split(":")[0] == f"1 / {len(params | consumers)}"


def By_CSS():
    from selenium.webdriver.common.by import By

    return By.CSS_SELECTOR


def test_open_a_folded_block_see_its_ops_and_go_back(browser, gpt2):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    report, _, path = gpt2
    browser.get(f"file://{path}")
    folds = _current(browser, "g.gs-fold")
    assert folds, "the default GPT-2 drawing folds its repeated blocks"
    fold = folds[0]
    fid = fold.get_attribute("id")
    members = set(report.graph)
    fold.click()
    assert _wait(lambda: _scene(browser) == fid)
    crumbs = browser.find_element(By_CSS(), ".gs-crumbs").text
    assert crumbs.startswith("model") and "x" in crumbs.split("\u203a")[-1]
    data = _js(browser, "return JSON.parse(document.querySelector('script.gs-data').textContent).scenes")
    pattern = set(data["top"]["elements"][fid]["pattern"])
    # what the opened block shows: its ops, and boxes (sub-modules) that list the ops inside them
    ops = _current(browser, "g.gs-op:not(.gs-context)")
    boxes = _current(browser, "g.gs-group")
    assert ops and all(g.get_attribute("id") in members for g in ops)
    shown = {report.graph.nodes[g.get_attribute("id")]["name"] for g in ops}
    for g in boxes:
        shown |= set(data[fid]["elements"][g.get_attribute("id")]["op_names"])
    assert pattern <= shown, pattern - shown
    attn = next((g for g in boxes if g.get_attribute("id").endswith(".attn")), None)
    if attn is not None:                                  # one level further down: the attention ops
        aid = attn.get_attribute("id")
        attn.click()
        assert _wait(lambda: _scene(browser) == aid)
        assert len(browser.find_element(By_CSS(), ".gs-crumbs").text.split("\u203a")) == 3
        names = {report.graph.nodes[g.get_attribute("id")]["name"]
                 for g in _current(browser, "g.gs-op:not(.gs-context)")}
        assert {"SoftmaxBackward0", "BmmBackward0"} & names, names
        ActionChains(browser).send_keys(Keys.ESCAPE).perform()
        assert _wait(lambda: _scene(browser) == fid)
    ActionChains(browser).send_keys(Keys.ESCAPE).perform()           # Esc: back to the parent
    assert _wait(lambda: _scene(browser) == "top")
    assert _current(browser, f'g[id="{fid}"]')

    # a dashed stub for an op outside the block leads to that op, where it is drawn
    _current(browser, f'g[id="{fid}"]')[0].click()
    from gradscope.views.render import drawing

    inside = {n for n, e in drawing(report).element_of.items() if e == fid}
    stubs = _current(browser, "g.gs-context")
    assert stubs                                         # the ops just outside the drawn repetition
    stub = next(g for g in stubs if g.get_attribute("id") not in inside)
    sid = stub.get_attribute("id")
    stub.click()
    assert _wait(lambda: _scene(browser) != fid)
    assert [g.get_attribute("id") for g in _current(browser, "g.gs-hl")] == [sid]


def test_keyboard_zoom(browser, gpt2):
    from selenium.webdriver.common.action_chains import ActionChains

    _, _, path = gpt2
    browser.get(f"file://{path}")
    fit = _scale(browser)
    ActionChains(browser).send_keys("+").perform()
    assert _scale(browser) == pytest.approx(fit * 1.25, rel=1e-3)
    ActionChains(browser).send_keys("++").perform()
    assert _scale(browser) == pytest.approx(fit * 1.25 ** 3, rel=1e-3)
    ActionChains(browser).send_keys("-").perform()
    assert _scale(browser) == pytest.approx(fit * 1.25 ** 2, rel=1e-3)
    ActionChains(browser).send_keys("0").perform()
    assert _scale(browser) == pytest.approx(fit, rel=1e-3)
    # the keys act on the picture, not only on the attribute: a node grows on screen
    op = _current(browser, "g.gs-op")[0]
    before = _on_screen(browser, op)["width"]
    ActionChains(browser).send_keys("++").perform()
    assert _on_screen(browser, op)["width"] == pytest.approx(before * 1.5625, rel=0.02)


def test_click_a_finding_highlights_and_zooms_to_its_node(browser, tmp_path):
    from selenium.webdriver.common.by import By

    loss, model = planted()
    report = gradscope.inspect(loss, model=model)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()                                   # torch agrees the node is a hazard
    path = report.render(tmp_path / "graph.html")
    browser.get(f"file://{path}")
    svg = browser.find_element(By.CSS_SELECTOR, ".gs-canvas svg")
    assert svg.find_elements(By.CSS_SELECTOR, "g.node")
    view_box = lambda: browser.execute_script("return arguments[0].getAttribute('viewBox')", svg)  # noqa: E731
    before = view_box()
    assert before
    index = next(i for i, f in enumerate(report.findings) if f.kind == "inplace-hazard")
    node = report.findings[index].node
    browser.find_element(By.ID, f"gs-finding-{index}").click()
    hl = _wait(lambda: [g.get_attribute("id") for g in browser.find_elements(By.CSS_SELECTOR, "g.gs-hl")])
    # one hazard finding stands for every node that saved the stale tensor: all are highlighted
    assert node in hl and set(hl) == set(stale_savers(report.graph, node))
    assert browser.find_element(By.ID, node).get_attribute("data-gs-highlight") == "1"
    assert view_box() != before                          # the view moved to the node
    seen = _on_screen(browser, browser.find_element(By.ID, node))
    assert seen["inside"] and seen["text"] >= READABLE_PX, seen
    details = browser.find_element(By.CSS_SELECTOR, ".gs-details").text
    assert report.graph.nodes[node]["name"] in details and "STALE" in details

    # clicking the unused-parameter finding moves the highlight to the unused cluster's nodes
    unused = next(i for i, f in enumerate(report.findings) if f.kind == "unused-parameter")
    browser.find_element(By.ID, f"gs-finding-{unused}").click()
    hl = _wait(lambda: sorted(g.get_attribute("id") for g in browser.find_elements(By.CSS_SELECTOR, "g.gs-hl")))
    assert hl == ["unused:unused.bias", "unused:unused.weight"]


class _Block(torch.nn.Module):
    def __init__(self, bug: bool):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.bug = bug

    def forward(self, x):
        h = torch.sigmoid(self.lin(x))
        out = h * 2
        if self.bug:
            h.mul_(2)                      # SigmoidBackward0 saved h
        return out + x


def test_a_finding_in_a_tall_drawing_is_zoomed_to_readable_text(browser, tmp_path):
    from selenium.webdriver.common.by import By

    model = torch.nn.Sequential(*[_Block(bug=i == 29) for i in range(40)])
    loss = model(torch.randn(2, 8)).sum()
    report = gradscope.inspect(loss, model=model)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    (finding,) = report.findings
    path = report.render(tmp_path / "all.html", collapse=False)           # 40 blocks, one tall column
    browser.get(f"file://{path}")
    node = browser.find_element(By.ID, finding.node)
    assert _on_screen(browser, node)["text"] < READABLE_PX                # unreadable at fit
    fit = _scale(browser)
    browser.find_element(By.ID, "gs-finding-0").click()
    assert _wait(lambda: node.get_attribute("data-gs-highlight") == "1")
    seen = _on_screen(browser, node)
    assert _scale(browser) > fit and seen["inside"] and seen["text"] >= READABLE_PX, seen
    assert not _js(browser, "return document.querySelector('.gs-mini').hidden")   # the map shows where


def test_hovering_a_node_shows_its_saved_tensors_and_module(browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    loss, model = planted()
    report = gradscope.inspect(loss, model=model)
    path = report.render(tmp_path / "graph.html")
    browser.get(f"file://{path}")
    # the first Linear's addmm saved its input x (2×3 float32): 24 bytes
    node = next(n for n, d in report.graph.nodes(data=True)
                if d["name"] == "AddmmBackward0" and any(e["shape"] == [2, 3] for e in d["saved"]))
    ActionChains(browser).move_to_element(browser.find_element(By.ID, node)).perform()
    text = _wait(lambda: browser.find_element(By.CSS_SELECTOR, ".gs-details").text)
    assert "module: a" in text and "mat1: 2×3 float32 24 B" in text


def test_hovering_a_traced_node_shows_the_line_that_made_it(browser, tmp_path):
    import inspect as pyinspect

    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    from tests._render_models import Planted

    torch.manual_seed(0)
    model = Planted()
    with gradscope.trace(model) as tr:
        loss = model(torch.randn(2, 3))
    report = gradscope.inspect(loss, model=model, trace=tr)
    source, first = pyinspect.getsourcelines(Planted.forward)
    sig = first + next(i for i, t in enumerate(source) if "torch.sigmoid(" in t)   # the real source line
    node = next(n for n, d in report.graph.nodes(data=True) if d["name"] == "SigmoidBackward0")
    assert report.graph.nodes[node]["location"] == f"_render_models.py:{sig}"
    browser.get(f"file://{report.render(tmp_path / 'graph.html')}")
    ActionChains(browser).move_to_element(browser.find_element(By.ID, node)).perform()
    text = _wait(lambda: browser.find_element(By.CSS_SELECTOR, ".gs-details").text)
    assert f"at _render_models.py:{sig}" in text, text


# Jupyter's own rendered-HTML rules that broke the old display (JupyterLab's .jp-RenderedHTMLCommon)
JUPYTER_CSS = (".jp-RenderedHTMLCommon td,.jp-RenderedHTMLCommon th,.jp-RenderedHTMLCommon li,"
               ".jp-RenderedHTMLCommon p{text-align:right}.jp-RenderedHTMLCommon svg{max-width:100%;height:auto}"
               ".jp-RenderedHTMLCommon ol{padding-left:2em}")


def test_notebook_pane_is_sized_to_the_drawing_and_reads_left_aligned(browser, tmp_path):
    from selenium.webdriver.common.by import By

    loss, model = planted()
    report = gradscope.inspect(loss, model=model)
    out = tmp_path / "nb.html"
    out.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'><style>{JUPYTER_CSS}</style></head><body>"
                   f"<div class='jp-RenderedHTMLCommon' style='width:1100px'>{repr_html(report)}</div></body></html>",
                   encoding="utf-8")
    browser.get(f"file://{out}")
    items = browser.find_elements(By.CSS_SELECTOR, ".gs-findings li")
    assert len(items) == len(report.findings)            # one list of findings, nothing else
    assert not browser.find_elements(By.CSS_SELECTOR, "table")
    assert {li.value_of_css_property("text-align") for li in items} <= {"left", "start"}
    pane = _js(browser, """var v=document.querySelector('.gs-view'),c=v.querySelector('.gs-canvas'),
        s=v.querySelector('.gs-scene svg').getBoundingClientRect(),vb=v.querySelector('.gs-scene svg').viewBox.baseVal;
        return {view:v.getBoundingClientRect().height,canvas:c.getBoundingClientRect().height,svg:s.height,
                home:JSON.parse(v.querySelector('script.gs-data').textContent).scenes.top};""")
    assert pane["svg"] == pytest.approx(pane["canvas"], abs=2)   # Jupyter's svg{height:auto} did not win
    assert 320 <= pane["view"] <= 0.85 * 900 + 1
    # the planted model is small: its text is drawn at least at its natural size
    node = next(f.node for f in report.findings if f.kind == "inplace-hazard")
    assert _on_screen(browser, browser.find_element(By.ID, node))["text"] >= READABLE_PX
    # the same keys and search as the page
    browser.find_element(By.CSS_SELECTOR, ".gs-view").click()
    fit = _scale(browser)
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(browser).send_keys("+").perform()
    assert _scale(browser) == pytest.approx(fit * 1.25, rel=1e-3)
    assert _search(browser, "unused.bias").startswith("1 / 1")
    assert [g.get_attribute("id") for g in _current(browser, "g.gs-cur")] == ["unused:unused.bias"]


def test_hostile_names_do_not_break_the_viewer(browser, tmp_path):
    from tests.views.test_render_html import HOSTILE

    params = {name: torch.nn.Parameter(torch.randn(3)) for name in HOSTILE}
    report = gradscope.inspect(sum((p * (i + 2)).sum() for i, p in enumerate(params.values())), params=params)
    browser.get(f"file://{report.render(tmp_path / 'g.html')}")
    assert _js(browser, "return document.querySelector('.gs-view').dataset.gsReady") == "1"   # the script ran
    assert not _js(browser, "return document.querySelectorAll('body > b, .gs-view b:not(.gs-crumbs b)').length")
    assert _search(browser, "<!--<script>").startswith("1 / 1")


def test_the_same_output_shown_twice_works_in_both_views(browser, tmp_path):
    """Jupyter can show one output in two places (a second view of the notebook): same HTML, same ids."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    loss, model = planted()
    out = repr_html(gradscope.inspect(loss, model=model))
    page = tmp_path / "twice.html"
    page.write_text(f"<!DOCTYPE html><html><body>{out}{out}</body></html>", encoding="utf-8")
    browser.get(f"file://{page}")
    views = browser.find_elements(By.CSS_SELECTOR, ".gs-view")
    assert [v.get_attribute("data-gs-ready") for v in views] == ["1", "1"]
    scale = lambda v: float(v.find_element(By.CSS_SELECTOR, ".gs-scene svg").get_attribute("data-gs-scale"))  # noqa: E731
    before = [scale(v) for v in views]
    views[1].find_element(By.CSS_SELECTOR, ".gs-side h4").click()
    ActionChains(browser).send_keys("+").perform()
    assert scale(views[1]) == pytest.approx(before[1] * 1.25, rel=1e-3) and scale(views[0]) == before[0]


def test_chart_text_stays_inside_the_picture(browser, tmp_path):
    """Every line of text in the charts (gradient flow, backward curve, what-if, plan), measured with real
    glyphs, ends inside the SVG's width: no caption is cut at the right edge."""
    from tests.views.test_charts import charts

    for name, to_svg in charts().items():
        path = to_svg(tmp_path / f"{name}.svg")
        browser.get(f"file://{path}")
        width, overflow = browser.execute_script(
            "const svg = document.querySelector('svg');"
            "const w = svg.viewBox.baseVal && svg.viewBox.baseVal.width || svg.width.baseVal.value;"
            "const out = [];"
            "for (const t of svg.querySelectorAll('text')) {"
            "  const b = t.getBBox();"
            "  if (b.x + b.width > w + 0.5 || b.x < -0.5) out.push([t.textContent, b.x, b.width]);"
            "}"
            "return [w, out];"
        )
        assert width > 0 and not overflow, (name, width, overflow)
