"""Golden text and JSON: the summary, the memory table, explain() and the saved report of the planted
models, byte for byte (regenerate with GRADSCOPE_UPDATE_GOLDEN=1 when a change is intended)."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

import gradscope
from tests._render_models import planted, tied

GOLDEN = pathlib.Path(__file__).parents[1] / "golden"


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("GRADSCOPE_UPDATE_GOLDEN") == "1":
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"missing golden file {path}; run with GRADSCOPE_UPDATE_GOLDEN=1"
    assert text == path.read_text(encoding="utf-8"), f"{name} changed; if intended, GRADSCOPE_UPDATE_GOLDEN=1"


def _report(build):
    loss, model = build()
    return gradscope.inspect(loss, model=model)


@pytest.mark.parametrize("name, build", [("planted", planted), ("tied", tied)])
def test_golden_summary_and_memory_table(name, build):
    report = _report(build)
    assert report.summary() == _report(build).summary()  # two independent builds agree
    _golden(f"{name}.summary.txt", report.summary() + "\n")
    _golden(f"{name}.memory.txt", str(report.memory()) + "\n")


def test_golden_explain():
    report = _report(planted)
    _golden("planted.explain.txt", report.explain("unused.weight") + "\n" + report.explain("a.weight") + "\n")


def test_golden_json():
    data = _report(planted).to_json()
    # sequence numbers count every node made in this thread so far: keep their order, not their values
    seqs = sorted({d["seq"] for d in data["nodes"] if d.get("seq") is not None})
    for d in data["nodes"]:
        if d.get("seq") is not None:
            d["seq"] = seqs.index(d["seq"])
    for i, p in enumerate(data["graph"]["params"].values()):
        p["pid"] = i  # id() of the parameter tensor: an address
    _golden("planted.json", json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")


@pytest.mark.parametrize("n,word", [(1, "saved tensor"), (2, "saved tensors")])
def test_counts_agree_with_their_noun(n, word):
    import torch

    x = torch.randn(3, requires_grad=True)
    y = x.exp() if n == 1 else x * x              # exp saves its result; mul saves both operands
    report = gradscope.inspect(y.sum(), params={"x": x})
    saved = sum(len(d["saved"]) for _, d in report.graph.nodes(data=True))
    assert saved == n
    first = report.summary().splitlines()[0]
    assert f"held by {n} {word}" in first and f"held by {n} {word}s" not in first
    assert "1 saved tensors" not in report.summary()


def test_plural_helper():
    from gradscope._format import plural

    assert [plural(0, "node"), plural(1, "node"), plural(2, "node")] == ["0 nodes", "1 node", "2 nodes"]
    assert plural(1, "parameter is", "parameters are") == "1 parameter is"
    assert plural(4, "parameter is", "parameters are") == "4 parameters are"
