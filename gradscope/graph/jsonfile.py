"""The JSON form of ``report.graph``: networkx node-link data (library defaults), read back validated.

``networkx.node_link_graph(json.load(f))`` reads the graph back; :meth:`gradscope.report.Report.from_json`
rebuilds the whole report from :func:`graph_from_data` (adding the fields of its own, findings and saved
bytes, that :meth:`~gradscope.report.Report.to_json` stored in the graph attributes); :func:`read_json`
reads a file with one clear sentence for every way it can be wrong.
"""

from __future__ import annotations

import json
import os

import networkx as nx

from gradscope.errors import InputTypeError, InputValueError
from gradscope.graph.validation import validate

__all__ = ["FORMAT", "graph_to_data", "graph_from_data", "read_json"]

#: The format tag a saved report carries in its graph attributes.
FORMAT = "gradscope-report/1"


def graph_to_data(graph: nx.DiGraph, **extra) -> dict:
    """Node-link data of ``graph``, with the format tag and ``extra`` added to its graph attributes."""
    data = nx.node_link_data(graph)
    data["graph"] = {**data.get("graph", {}), "format": FORMAT, **extra}
    return data


def graph_from_data(data: dict, source: str = "the report") -> nx.DiGraph:
    """The graph of :func:`graph_to_data` output, validated first (:mod:`gradscope.graph.validation`).

    Raises:
        InputValueError: ``data`` is not a gradscope report (the first bad field is named).
    """
    edges = validate(data, source)
    graph = nx.node_link_graph(data, directed=True, multigraph=False, edges=edges)
    graph.graph.pop("format", None)
    return graph


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
