"""Everything a maintainer is pointed at is inside the repository: no pointer to a facts document kept
outside it, no absolute path of a development machine, every ``internals.md#section`` link
names a section of docs/internals.md, and every entry there names tests that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("gradscope", "tests", "docs", "bench", "notebooks")
#: Built from pieces, so that this file does not match itself.
OUTSIDE_DOC = "TORCH" + "-FACTS"
MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:" + "|".join(("work", "root", "home")) + r")/")
LINK = re.compile(r"internals\.md#([\w-]+)((?:,? (?:and )?#[\w-]+)*)")


def _files():
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in (".py", ".md", ".txt", ".cfg", ".toml", ".html", ".js", ".ipynb") and path.is_file():
                yield path
    yield from (ROOT / name for name in ("README.md", "setup.py", "setup.cfg", "Makefile", "ruff.toml"))


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors() -> set[str]:
    text = (ROOT / "docs" / "internals.md").read_text(encoding="utf-8")
    return {_slug(m.group(1)) for m in re.finditer(r"^#{2,3} (.+)$", text, re.M)}


def test_no_reference_outside_the_repository_and_no_machine_path():
    bad = []
    for path in _files():
        for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if OUTSIDE_DOC in line or MACHINE_PATH.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not bad, "point at docs/internals.md#section or a torch source path instead:\n" + "\n".join(bad)


def test_every_internals_link_names_a_section():
    anchors = _anchors()
    assert {"sequence-numbers", "engine-order", "measuring-memory-with-torchprofiler"} <= anchors
    bad, seen = [], 0
    for path in _files():
        if path == Path(__file__).resolve():
            continue
        for m in LINK.finditer(path.read_text(encoding="utf-8", errors="replace")):
            names = [m.group(1), *re.findall(r"#([\w-]+)", m.group(2) or "")]
            seen += len(names)
            bad += [f"{path.relative_to(ROOT)}: #{n}" for n in names if n not in anchors]
    assert seen > 20 and not bad, f"links to sections docs/internals.md does not have: {bad}"


def test_the_scans_see_what_they_look_for():
    scanned = set(_files())
    assert ROOT / "notebooks" / "quickstart.ipynb" in scanned and ROOT / "setup.cfg" in scanned
    assert MACHINE_PATH.search("see " + "/ho" + "me/me/x.py") and not MACHINE_PATH.search("a/home/b")
    assert _slug("Measuring memory with torch.profiler") == "measuring-memory-with-torchprofiler"
    named = _named_tests("Checked by `test_a`; `tests/x.py::test_b` and `tests/y.py`.")
    assert [(p.name, n) for p, n in named] == [("test_torch_facts.py", "test_a"), ("x.py", "test_b"), ("y.py", None)]


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _named_tests(section: str) -> list[tuple[Path, str | None]]:
    """The tests a section of docs/internals.md names: ``path::name``, a test file, or a bare ``test_...``
    of tests/walk/test_torch_facts.py (path, None for a whole file)."""
    out: list[tuple[Path, str | None]] = []
    for ref in re.findall(r"`([^`\s]+)`", section):
        if "::" in ref:
            path, name = ref.split("::", 1)
            out.append((ROOT / path, name))
        elif ref.startswith("tests/") and ref.endswith(".py"):
            out.append((ROOT / ref, None))
        elif re.fullmatch(r"test_\w+", ref):
            out.append((ROOT / "tests" / "walk" / "test_torch_facts.py", ref))
    return out


def test_every_internals_entry_names_tests_that_exist():
    text = (ROOT / "docs" / "internals.md").read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) > 20
    bad, seen = [], 0
    for section in sections:
        title = section.splitlines()[0]
        named = _named_tests(section)
        if not named:
            bad.append(f"{title}: names no test")
        for path, name in named:
            seen += 1
            if not path.is_file() or (name is not None and name not in _test_names(path)):
                bad.append(f"{title}: {path.relative_to(ROOT)}{'::' + name if name else ''} does not exist")
    assert seen > 40 and not bad, "docs/internals.md names tests that do not exist:\n" + "\n".join(bad)


# -- docs/architecture.md is the map of the tree as it is -----------------------------------------------
def _named_in_architecture() -> tuple[set[str], set[str]]:
    """The file paths (``x.py``, ``a/x.py``) and folders (``a/``, ``a/b/``) docs/architecture.md names in backticks."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    tokens = set(re.findall(r"`([\w./]+)`", text))
    return {t for t in tokens if t.endswith(".py")}, {t for t in tokens if t.endswith("/") and "." not in t}


def _tree() -> tuple[list[str], list[str]]:
    tops = ("gradscope", "tests", "bench", "docs")
    files = [p.relative_to(ROOT).as_posix() for top in tops for p in (ROOT / top).rglob("*.py")]
    dirs = [p.relative_to(ROOT).as_posix() + "/" for top in tops for p in (ROOT / top).rglob("*")
            if p.is_dir() and p.name != "__pycache__"]  # fmt: skip
    return files, [*dirs, *(t + "/" for t in tops)]


def test_the_architecture_map_names_only_what_exists():
    files, dirs = _tree()
    py, folders = _named_in_architecture()
    assert {"walk/", "replay/"} <= folders and {"build.py", "table.py", "memory/replay/steps.py"} <= py  # it reads
    missing = sorted(t for t in py if not any(f == t or f.endswith("/" + t) for f in files))
    missing += sorted(t for t in folders if not any(d == t or d.endswith("/" + t) for d in dirs))
    assert not missing, f"docs/architecture.md names what the tree does not have: {missing}"


def test_the_architecture_map_names_every_module_and_folder_of_the_package():
    py, folders = _named_in_architecture()
    bare = {t.rpartition("/")[2] for t in py}
    package = ROOT / "gradscope"
    unnamed = [p.relative_to(package).as_posix() for p in sorted(package.rglob("*.py"))
               if p.name != "__init__.py" and p.name not in bare]  # fmt: skip
    drawn = {f.rstrip("/").rpartition("/")[2] for f in folders}
    unnamed += [f"{p.parent.relative_to(package).as_posix()}/" for p in sorted(package.rglob("__init__.py"))
                if p.parent != package and p.parent.name not in drawn]  # fmt: skip
    assert not unnamed, f"docs/architecture.md does not place these (say what each holds): {unnamed}"
