"""The JSON form of a report: networkx node-link data (library defaults) plus findings.

``networkx.node_link_graph(json.load(f))`` reads the graph back; :func:`gradscope.report.load` rebuilds
the whole :class:`~gradscope.report.Report` from :func:`read_json` and :func:`graph_from_data` (checks
are not re-run: the findings are stored, including those that came from a trace).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import networkx as nx

from gradscope.errors import InputValueError
from gradscope.findings import Finding

if TYPE_CHECKING:
    from gradscope.report import Report

__all__ = ["report_to_data", "graph_from_data", "read_json"]

FORMAT = "gradscope-report/1"


def report_to_data(report: Report) -> dict:
    """Node-link data of ``report.graph`` with ``findings`` and ``saved_bytes`` in its graph attributes."""
    data = nx.node_link_data(report.graph)
    graph_attrs = dict(data.get("graph", {}))
    graph_attrs["format"] = FORMAT
    graph_attrs["findings"] = [f.to_dict() for f in report.findings]
    graph_attrs["saved_bytes"] = report.saved_bytes
    data["graph"] = graph_attrs
    return data


def graph_from_data(data: dict) -> tuple[nx.DiGraph, list[Finding]]:
    """The graph and findings of :func:`report_to_data` output (``gradscope.report.load`` makes the Report).

    Raises:
        InputValueError: ``data`` is not a gradscope report.
    """
    if not isinstance(data, dict) or "nodes" not in data:
        raise InputValueError("this is not a gradscope report: the JSON has no 'nodes' list. "
                              "Write one with report.render('graph.json').")
    graph = nx.node_link_graph(data)
    attrs = graph.graph
    findings = [Finding.from_dict(f) for f in attrs.pop("findings", [])]
    attrs.pop("format", None)
    attrs.pop("saved_bytes", None)
    return graph, findings


def read_json(path: str | os.PathLike) -> dict:
    """The JSON data of a file written by ``report.render("x.json")``.

    Raises:
        InputValueError: the file is missing or is not JSON.
    """
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise InputValueError(f"no such report file: {os.fspath(path)!r}.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputValueError(f"{os.fspath(path)!r} is not JSON ({exc}); pass a file written by "
                              "report.render('x.json').") from None
