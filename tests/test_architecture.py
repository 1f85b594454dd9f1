"""The package's import graph, built with ``ast`` (imports inside functions included), stays a DAG.

Rules (docs/architecture.md): no import cycle anywhere in gradscope/, imports under ``TYPE_CHECKING``
included (a cycle through a type hint is still a cycle); no upward import between folders (walk < graph <
checks / memory / tracing / watching < views < report < cli); only the walk itself and the code that runs it
on live tensors import ``gradscope.walk``; views never import ``gradscope.report``; every
module at most 350 lines, every function at most 100, no folder of more than 20 modules (the allow-lists
of exceptions are empty and stay so); no module reaches into another module's
private (``_``-prefixed) names (the walk, being rewritten, aside), except from the helper modules
(``gradscope._format``, ``gradscope._torch``, ``checks._nodes``) that exist to be shared; private torch API
only in ``gradscope/_torch.py`` and the facts registry that probes them (``_torchcheck.py``, ``_torchprobes.py``;
and, until it is routed there, the walk).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "gradscope"

#: Modules outside gradscope/walk/ allowed to import the walk: inspect() runs it; trace()'s torch-function
#: mode keeps the nodes it touched until the tensor dies (the deep-graph release,
#: docs/internals.md#freeing-deep-graphs);
#: watch()'s cross-step checks walk the live graph of each step with the walk's node classifier, and its armed
#: backward hooks every node it reaches; both through the one bounded traversal (walk/traverse.py).
#: backward_memory()'s model of a traced reentrant checkpoint walks the meta graph it rebuilt (memory/replay/traced.py).
WALK_USERS = {
    "gradscope.inspection",
    "gradscope.tracing.modes",
    "gradscope.watching.walks",
    "gradscope.watching.origin",
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


def _imports(tree: ast.AST, name: str, is_pkg: bool, known: set[str], type_only: bool = True):
    """(imported module, imported names) for every import in ``tree``; those under ``if TYPE_CHECKING:``
    only when ``type_only``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_only:
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


def import_graph(type_only: bool = True) -> tuple[nx.DiGraph, dict]:
    mods = _modules()
    known = set(mods)
    g = nx.DiGraph()
    private: dict[tuple[str, str], list[str]] = {}
    for name, path in mods.items():
        g.add_node(name)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for target, names in _imports(tree, name, path.name == "__init__.py", known, type_only):
            if target in known and target != name:
                g.add_edge(name, target)
                hidden = [n for n in names if n.startswith("_") and not n.startswith("__")]
                if hidden:
                    private[(name, target)] = hidden
    return g, private


GRAPH, PRIVATE = import_graph()  # every import: at module level, inside functions, under TYPE_CHECKING


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
    got = {m for m, _ in _imports(ast.parse(src), "gradscope.views.text", False, known, False)} & known
    assert got == {"gradscope.walk.build", "gradscope.views.style", "gradscope._torch", "gradscope"}
    every = {m for m, _ in _imports(ast.parse(src), "gradscope.views.text", False, known)} & known
    assert every == got | {"gradscope.report"}  # the cycle and layer rules count type-only imports too


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
    assert "gradscope.report" not in reached, f"{view} imports gradscope.report (take the report as an argument)"


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
                                        and m not in ("gradscope._torch", "gradscope._torchcheck",
                                                      "gradscope._torchprobes")))
def test_private_torch_api_only_in_torch_module(name):
    assert not _private_torch_uses(_modules()[name]), (
        f"{name} uses private torch API; route it through gradscope/_torch.py")


def test_the_private_torch_scan_finds_the_walk_uses():
    # the walk is not yet routed through _torch.py: the scanner must see its uses, or it proves nothing
    assert _private_torch_uses(PKG / "walk" / "loop.py")
    assert _private_torch_uses(PKG / "_torch.py")


# -- layers -------------------------------------------------------------------------------------------
#: Folders by layer: a module may import its own folder and lower layers, never a higher one. Views take the
#: report as an argument and never import it (not even for a type), so ``report``, which hands each question
#: to the package that answers it (``report.render()`` -> views), stands above them.
FOLDER_LAYER = {"walk": 1, "graph": 2, "checks": 3, "memory": 3, "tracing": 3, "watching": 3, "views": 4, "cli": 7}
#: Top-level modules by layer: the base (errors, findings, formatting, the torch shim, frames, charts) below
#: every folder; the report and the pipeline that makes it above the views; the package's face and the CLI on top.
TOP_LAYER = {
    "gradscope.errors": 0, "gradscope.findings": 0, "gradscope._format": 0, "gradscope._torch": 0,
    "gradscope._wrappers": 0, "gradscope._torchcheck": 0, "gradscope._torchprobes": 0, "gradscope._frames": 0,
    "gradscope.svgchart": 0,
    "gradscope.report": 5,
    "gradscope.inspection": 5,
    "gradscope.compare": 5, "gradscope": 6, "gradscope.demo": 7, "gradscope.__main__": 8,
}  # fmt: skip


def _layer(module: str) -> tuple[str, int]:
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in FOLDER_LAYER):
        return parts[1], FOLDER_LAYER[parts[1]]
    return module, TOP_LAYER[module]


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in GRAPH if (m.split(".")[1] if m.count(".") else m) not in FOLDER_LAYER
                      and m not in TOP_LAYER)
    assert not unplaced, f"give these modules a layer in FOLDER_LAYER / TOP_LAYER: {unplaced}"


def test_no_upward_imports():
    bad = sorted(f"{u} -> {v}" for u, v in GRAPH.edges if _layer(v)[1] > _layer(u)[1])
    assert not bad, "upward imports (move the code down, or pass the value in): " + "; ".join(bad)


def test_the_layer_rule_sees_an_upward_import():
    assert _layer("gradscope.memory.replay.engine") == ("memory", 3) and _layer("gradscope.report")[1] == 5
    assert _layer("gradscope.views.text")[1] > _layer("gradscope.memory.table")[1]
    assert GRAPH.has_edge("gradscope.report", "gradscope.views.render")  # inside a method: counted


# -- sizes --------------------------------------------------------------------------------------------
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_FOLDER_MODULES = 350, 100, 20

#: Exceptions to the size limits: empty. Nothing may be added; split the module or name the function's pieces.
ALLOWED_BIG_MODULES: set[str] = set()
ALLOWED_BIG_FUNCTIONS: set[str] = set()


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def _functions(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


def test_modules_are_small():
    big = {m: _lines(p) for m, p in _modules().items() if _lines(p) > MAX_MODULE_LINES}
    assert set(big) <= ALLOWED_BIG_MODULES, (
        f"modules over {MAX_MODULE_LINES} lines (split them by question): "
        f"{ {m: n for m, n in big.items() if m not in ALLOWED_BIG_MODULES} }")
    assert set(big) >= ALLOWED_BIG_MODULES, f"now small enough, drop from the list: {ALLOWED_BIG_MODULES - set(big)}"


def test_functions_are_small():
    big = {f"{m}:{name}": n for m, p in _modules().items() for name, n in _functions(p) if n > MAX_FUNCTION_LINES}
    assert set(big) <= ALLOWED_BIG_FUNCTIONS, (
        f"functions over {MAX_FUNCTION_LINES} lines (name their pieces): "
        f"{ {f: n for f, n in big.items() if f not in ALLOWED_BIG_FUNCTIONS} }")
    assert set(big) >= ALLOWED_BIG_FUNCTIONS, f"now small enough, drop: {ALLOWED_BIG_FUNCTIONS - set(big)}"


def test_folders_are_small():
    folders: dict[Path, int] = {}
    for path in PKG.rglob("*.py"):
        folders[path.parent] = folders.get(path.parent, 0) + 1
    big = {str(f.relative_to(ROOT)): n for f, n in folders.items() if n > MAX_FOLDER_MODULES}
    assert not big, f"folders of more than {MAX_FOLDER_MODULES} modules (split them by question): {big}"


def test_the_size_rules_measure():
    assert _lines(PKG / "report.py") > 50
    assert max(n for _, n in _functions(PKG / "walk" / "loop.py")) > 20


def test_only_the_walk_reads_next_functions():
    # one bounded traversal of a live graph (walk/traverse.py); everyone else calls it
    bad = sorted(m for m, p in _modules().items() if not m.startswith("gradscope.walk")
                 and any(isinstance(n, ast.Attribute) and n.attr == "next_functions"
                         for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))))
    assert not bad, f"these modules walk a live graph themselves (use gradscope.walk.traverse): {bad}"
