"""The HTML view in a real headless browser: Debian's chromium driven by selenium (no browser download)."""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest

import gradscope
from gradscope.checks.inplace import stale_savers
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


def test_click_a_finding_highlights_and_centres_its_node(browser, tmp_path):
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
    assert view_box() != before                          # the view moved to centre the node
    details = browser.find_element(By.CSS_SELECTOR, ".gs-details").text
    assert report.graph.nodes[node]["name"] in details and "STALE" in details

    # clicking the unused-parameter finding moves the highlight to the unused cluster's nodes
    unused = next(i for i, f in enumerate(report.findings) if f.kind == "unused-parameter")
    browser.find_element(By.ID, f"gs-finding-{unused}").click()
    hl = _wait(lambda: sorted(g.get_attribute("id") for g in browser.find_elements(By.CSS_SELECTOR, "g.gs-hl")))
    assert hl == ["unused:unused.bias", "unused:unused.weight"]


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
