"""The report saves and reads itself: Report.to_json() / Report.from_json() / Report.load(), the one path
behind render('x.json') and gradscope.load()."""

from __future__ import annotations

import json

import networkx as nx
import pytest
import torch

import gradscope
from gradscope.errors import InputValueError
from gradscope.report import Report


def _report() -> Report:
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1), torch.nn.Linear(1, 1))
    frozen = torch.nn.Linear(3, 3)  # a parameter the loss never reaches: an unused-parameter finding
    model = torch.nn.ModuleDict({"net": net, "frozen": frozen})
    return gradscope.inspect(net(torch.randn(2, 3)).sum(), model=model)


def test_from_json_rebuilds_graph_findings_and_bytes():
    report = _report()
    assert report.findings, "the planted unused parameter must be found, or the round trip proves little"
    back = Report.from_json(json.loads(json.dumps(report.to_json())))
    assert nx.utils.graphs_equal(back.graph, report.graph)
    assert back.findings == report.findings and back.saved_bytes == report.saved_bytes
    assert "findings" not in back.graph.graph and "format" not in back.graph.graph


def test_render_json_and_load_are_to_json_and_from_json(tmp_path):
    report = _report()
    path = tmp_path / "r.json"
    report.render(path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(report.to_json(), default=str))
    for back in (gradscope.load(path), Report.load(path)):
        assert nx.utils.graphs_equal(back.graph, report.graph) and back.findings == report.findings


def test_from_json_refuses_a_node_of_the_wrong_shape():
    data = _report().to_json()
    data["nodes"][0]["saved_bytes"] = "many"
    with pytest.raises(InputValueError, match=r"nodes\[0\]\.saved_bytes"):
        Report.from_json(data)


def test_a_schema_field_not_checked_by_hand_is_checked_from_its_annotation():
    # NodeAttrs.requires_grad is a bool; validation.py has no line for it, the TypedDict says it
    data = _report().to_json()
    i = next(i for i, d in enumerate(data["nodes"]) if "requires_grad" in d)
    data["nodes"][i]["requires_grad"] = "yes"
    with pytest.raises(InputValueError, match=rf"nodes\[{i}\]\.requires_grad: expected true or false"):
        Report.from_json(data)
    data["nodes"][i]["requires_grad"] = True
    data["nodes"][i]["not_in_the_schema"] = "kept"  # a field a newer gradscope may add
    assert Report.from_json(data).graph.nodes[data["nodes"][i]["id"]]["not_in_the_schema"] == "kept"


def test_a_nested_tensor_graph_loads_back(tmp_path):
    # A nested tensor has no one shape: the walk writes None, and load() must take back what render() wrote.
    y = torch.nested.nested_tensor([torch.randn(3), torch.randn(5)], requires_grad=True)
    report = gradscope.inspect(torch.nested.to_padded_tensor(y * 2, 0.0).sum())
    nodes = report.graph.nodes.values()
    assert any(None in (a.get("out_shapes") or []) or ("shape" in a and a["shape"] is None) for a in nodes)
    path = report.render(tmp_path / "nested.json")
    back = gradscope.load(path)
    assert nx.utils.graphs_equal(back.graph, report.graph)


def test_a_file_without_its_edges_is_refused_in_one_sentence(tmp_path):
    data = _report().to_json()
    del data["edges"]
    path = tmp_path / "no-edges.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InputValueError, match="'edges' list is missing"):
        gradscope.load(path)
