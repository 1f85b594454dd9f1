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

from gradscope.errors import InputTypeError, InputValueError
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


def graph_from_data(data: dict, source: str = "the report") -> tuple[nx.DiGraph, list[Finding]]:
    """The graph and findings of :func:`report_to_data` output, validated first (:mod:`gradscope.graph.validation`);
    ``gradscope.report.load`` makes the Report.

    Raises:
        InputValueError: ``data`` is not a gradscope report (the first bad field is named).
    """
    from gradscope.graph.validation import validate

    edges = validate(data, source)
    graph = nx.node_link_graph(data, directed=True, multigraph=False, edges=edges)
    attrs = graph.graph
    findings = [Finding.from_dict(f) for f in attrs.pop("findings", [])]
    attrs.pop("format", None)
    attrs.pop("saved_bytes", None)
    return graph, findings


def read_json(path: str | os.PathLike) -> tuple[dict, str]:
    """The JSON data of a file written by ``report.render("x.json")``, and the file's name as messages show it.

    Raises:
        InputTypeError: ``path`` is not a str or path-like object.
        InputValueError: the file is missing or unreadable, is not JSON, or is not a gradscope report.
    """
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise InputTypeError(
            f"gradscope.load() takes the path of a report file (str or pathlib.Path), got {type(path).__name__}."
        )
    try:
        name = os.fspath(path)
    except TypeError as exc:
        raise InputTypeError(f"gradscope.load() got a path-like object whose __fspath__ fails ({exc}).") from None
    if not isinstance(name, str) or "\0" in name:
        raise InputValueError(f"{name!r} is not a usable file name (it holds a NUL byte or is not text).")
    shown = repr(name) if len(name) < 200 else repr(name[:197] + "...")
    if os.path.isdir(name):
        raise InputValueError(f"{shown} is a folder; pass the report file written by report.render('x.json').")
    try:
        with open(name, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise InputValueError(f"no such report file: {shown}.") from None
    except OSError as exc:
        raise InputValueError(f"cannot read {shown}: {exc.strerror or exc}.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputValueError(f"{shown} is not JSON ({exc}); pass a file written by report.render('x.json').") from None
    except RecursionError:
        raise InputValueError(f"{shown} is not a gradscope report: its JSON is nested too deeply to be one.") from None
    except ValueError:  # an integer of more digits than Python converts (4300 by default)
        raise InputValueError(
            f"{shown} is not a gradscope report: it holds an integer thousands of digits long."
        ) from None
    return data, shown
