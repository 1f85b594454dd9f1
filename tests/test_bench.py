"""The benchmark scripts in bench/ still import against today's package (a moved name breaks them at import,
as ``CompactGraph`` once did). They are imported, never run: speed lives in bench/, not in tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_IMPORT_ALL = """
import importlib, pathlib, sys
sys.path[:0] = ["bench", "."]
names = sorted(p.stem for p in pathlib.Path("bench").glob("*.py"))
for name in names:
    importlib.import_module(name)
print(" ".join(names))
"""


def test_every_bench_script_imports():
    scripts = sorted(p.stem for p in (ROOT / "bench").glob("*.py"))
    assert {"fixed_bench", "memory_bench", "watch_bench", "render_budget_bench"} <= set(scripts)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, f"a bench script fails at import:\n{done.stderr[-3000:]}"
    assert done.stdout.split() == scripts
