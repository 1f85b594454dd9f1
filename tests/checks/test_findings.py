"""Finding kinds and severities are named constants, checked when a Finding is made and when a report is read."""

from __future__ import annotations

import pytest
import torch

import gradscope
from gradscope import findings as F
from gradscope.errors import InputValueError
from gradscope.report import Report


def test_every_kind_has_a_constant_and_the_constants_are_the_kinds():
    named = {v for k, v in vars(F).items() if k.isupper() and isinstance(v, str) and "-" in v}
    assert named == set(F.KINDS) and len(F.KINDS) == len(set(F.KINDS))
    assert F.SEVERITIES == (F.ERROR, F.WARNING, F.INFO)


@pytest.mark.parametrize("kind, severity", [("unused-parameters", "error"), ("unused-parameter", "fatal")])
def test_a_finding_of_an_unknown_kind_or_severity_is_refused(kind, severity):
    with pytest.raises(InputValueError, match="unknown (finding kind|severity)"):
        F.Finding(kind, severity, "text")


def test_severity_counts_are_the_reports_repr_and_summary():
    net = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
    report = gradscope.inspect(net["a"](torch.randn(1, 2)).sum(), model=net)  # b is unused: one error
    assert F.severity_counts(report.findings) == "1 error"
    assert "1 error>" in repr(report) and "Findings: 1 error" in report.summary()
    assert F.severity_counts([]) == ""


def test_a_saved_report_with_an_unknown_kind_is_refused_in_one_sentence():
    net = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
    data = gradscope.inspect(net["a"](torch.randn(1, 2)).sum(), model=net).to_json()
    data["graph"]["findings"][0]["kind"] = "made-up"
    with pytest.raises(InputValueError, match=r"graph\.findings\[0\]\.kind: expected one of unused-parameter"):
        Report.from_json(data)


def test_report_cache_holds_the_replay_program_and_is_emptied_with_a_new_graph():
    from gradscope.memory.replay.backward import PROGRAM_KEY, program

    x = torch.randn(3, requires_grad=True)
    report = gradscope.inspect((x.exp() * x).sum())
    prog = program(report)
    assert report.cache[PROGRAM_KEY][1] is prog and program(report) is prog  # compiled once
    report.graph = report.graph.copy()
    assert report.cache == {} and program(report) is not prog
    assert not [k for k in vars(report) if k.startswith("_gs_")]  # nothing hung on the report from outside
