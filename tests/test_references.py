"""Everything a maintainer is pointed at is inside the repository: no reference to the torch-facts document
that lived outside it, no absolute path of a development machine, and every ``internals.md#section`` link
names a section of docs/internals.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("gradscope", "tests", "docs", "bench")
#: Built from pieces, so that this file does not match itself.
OUTSIDE_DOC = "TORCH" + "-FACTS"
MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:" + "|".join(("work", "root", "home")) + r")/")
LINK = re.compile(r"internals\.md#([\w-]+)((?:,? (?:and )?#[\w-]+)*)")


def _files():
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in (".py", ".md", ".txt", ".cfg", ".toml", ".html", ".js") and path.is_file():
                yield path
    yield ROOT / "README.md"


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
    assert MACHINE_PATH.search("see " + "/ho" + "me/me/x.py") and not MACHINE_PATH.search("a/home/b")
    assert _slug("Measuring memory with torch.profiler") == "measuring-memory-with-torchprofiler"
