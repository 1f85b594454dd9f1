"""The package's import graph, built with ``ast`` (imports inside functions included), stays a DAG.

Rules (docs/architecture.md): no import cycle anywhere in gradscope/; only the walk itself and the code
that runs it on live tensors import ``gradscope.walk``; views import ``gradscope.report`` for type hints
only (under ``TYPE_CHECKING``, which this graph leaves out); no module reaches into another module's
private (``_``-prefixed) names (the walk, being rewritten, aside), except from the helper modules
(``gradscope._format``, ``gradscope._torch``, ``checks._nodes``) that exist to be shared; private torch API
only in ``gradscope/_torch.py`` (and, until it is routed there, the walk).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "gradscope"

#: Modules outside gradscope/walk/ allowed to import the walk: inspect() runs it; trace()'s torch-function
#: mode keeps the nodes it touched until the tensor dies (the deep-graph release, TORCH-FACTS section 11);
#: watch()'s cross-step checks walk the live graph of each step with the walk's node classifier.
#: backward_memory()'s model of a traced reentrant checkpoint walks the meta graph it rebuilt (memory/replay/traced.py).
WALK_USERS = {
    "gradscope.inspection",
    "gradscope.tracing.modes",
    "gradscope.watching.walks",
    "gradscope.memory.replay.traced",
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, name: str, is_pkg: bool, known: set[str]):
    """(imported module, imported names) for every import in ``tree``, outside ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = tuple(a.name for a in node.names)
            subs = [n for n in names if f"{mod}.{n}" in known]
            for n in subs:        # `from gradscope.views import render` imports the submodule
                yield f"{mod}.{n}", ()
            if len(subs) < len(names):
                yield mod, tuple(n for n in names if n not in subs)
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> tuple[nx.DiGraph, dict]:
    mods = _modules()
    known = set(mods)
    g = nx.DiGraph()
    private: dict[tuple[str, str], list[str]] = {}
    for name, path in mods.items():
        g.add_node(name)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for target, names in _imports(tree, name, path.name == "__init__.py", known):
            if target in known and target != name:
                g.add_edge(name, target)
                hidden = [n for n in names if n.startswith("_") and not n.startswith("__")]
                if hidden:
                    private[(name, target)] = hidden
    return g, private


GRAPH, PRIVATE = import_graph()


def test_the_graph_sees_the_package():
    # the builder must see the known structure, or the tests below prove nothing
    assert {"gradscope", "gradscope.report", "gradscope.views.render", "gradscope.walk.build"} <= set(GRAPH)
    assert GRAPH.has_edge("gradscope.inspection", "gradscope.walk.build")
    assert GRAPH.has_edge("gradscope.report", "gradscope.views.render")       # an import inside a method
    assert GRAPH.number_of_edges() > 60


def test_the_scanner_reads_function_imports_and_skips_type_checking():
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from gradscope.report import Report\n"
        "def f():\n    from gradscope.walk.build import build\n    from . import style\n"
        "    from gradscope import _torch, inspect\n"
    )
    known = {"gradscope", "gradscope.report", "gradscope.walk.build", "gradscope.views.style", "gradscope._torch"}
    got = {m for m, _ in _imports(ast.parse(src), "gradscope.views.text", False, known)} & known
    assert got == {"gradscope.walk.build", "gradscope.views.style", "gradscope._torch", "gradscope"}


def test_no_import_cycles():
    cycles = list(nx.simple_cycles(GRAPH))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:10])


def test_only_the_walk_and_inspect_import_the_walk():
    bad = sorted((u, v) for u, v in GRAPH.edges if v.startswith("gradscope.walk")
                 and not u.startswith("gradscope.walk") and u not in WALK_USERS)
    assert not bad, f"these modules import the walk (read report.graph / gradscope.graph instead): {bad}"


@pytest.mark.parametrize("view", sorted(m for m in GRAPH if m.startswith("gradscope.views")))
def test_views_never_import_the_report_or_the_walk(view):
    reached = nx.descendants(GRAPH, view)
    assert not {m for m in reached if m.startswith("gradscope.walk")}, f"{view} reaches the walk"
    assert "gradscope.report" not in reached, f"{view} imports gradscope.report outside TYPE_CHECKING"


def test_no_private_cross_module_imports():
    shared = ("gradscope._format", "gradscope._torch", "gradscope.checks._nodes")
    bad = {k: v for k, v in PRIVATE.items() if k[1] not in shared and not k[0].startswith("gradscope.walk")}
    assert not bad, f"private names imported from another module (make them public or move them): {bad}"


#: Attribute names that are private torch API (gradscope/_torch.py holds them).
_TORCH_PRIVATE = {"_C", "_sequence_nr", "_cdata", "_input_metadata", "_forward_cls", "_version",
                  "_execution_engine", "_foreach_norm", "_values", "_get_sequence_nr", "_raw_saved_tensors"}


def _private_torch_uses(path: Path) -> list[str]:
    out = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (node.attr in _TORCH_PRIVATE or node.attr.startswith(
                ("_saved_", "_raw_saved_"))):
            out.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(
                ("_saved_", "_raw_saved_")):
            out.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("torch._", "torch.nn.modules")):
            out.append(f"line {node.lineno}: from {node.module} import ...")
    return out


@pytest.mark.parametrize("name", sorted(m for m in _modules() if not m.startswith("gradscope.walk")
                                        and m != "gradscope._torch"))
def test_private_torch_api_only_in_torch_module(name):
    assert not _private_torch_uses(_modules()[name]), (
        f"{name} uses private torch API; route it through gradscope/_torch.py")


def test_the_private_torch_scan_finds_the_walk_uses():
    # the walk is not yet routed through _torch.py: the scanner must see its uses, or it proves nothing
    assert _private_torch_uses(PKG / "walk" / "loop.py")
    assert _private_torch_uses(PKG / "_torch.py")
