"""On a torch without a private API gradscope uses, the first import that needs torch says so in one
sentence (``UnsupportedTorchError``, an ``ImportError``), naming the API and the torch version: each case
removes one API in a fresh process, the way a future torch release would."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": _ROOT})


@pytest.mark.parametrize("owner,attr,named", [
    ("torch._C._autograd", "_get_sequence_nr", "torch._C._autograd._get_sequence_nr"),
    ("torch._C", "_current_autograd_node", "torch._C._current_autograd_node"),
    ("torch", "_foreach_norm", "torch._foreach_norm"),
    ("torch.nn.modules.module", "register_module_forward_hook",
     "torch.nn.modules.module.register_module_forward_hook"),
])
def test_a_missing_private_api_is_one_sentence_at_import(owner, attr, named):
    done = _run(
        "import importlib, torch\n"
        f"delattr(importlib.import_module({owner!r}), {attr!r})\n"
        "import gradscope\n"
        "try:\n"
        "    gradscope.inspect\n"
        "except gradscope.UnsupportedTorchError as e:\n"
        "    assert isinstance(e, ImportError) and isinstance(e, gradscope.GradscopeError)\n"
        "    print(e)\n"
    )
    assert done.returncode == 0, done.stderr
    message = done.stdout.strip()
    assert message.startswith(f"gradscope needs {named}, which torch ") and "2.13" in message, message
    assert len(message.splitlines()) == 1 and message.count(". ") == 0   # one sentence


def test_this_torch_passes_the_check():
    from gradscope._torchcheck import REQUIRED, check_torch

    check_torch()                 # the torch of this environment has every API: no error
    assert "_C._autograd._get_sequence_nr" in REQUIRED


def test_the_check_names_every_private_torch_attribute_the_shim_reads():
    """Every ``torch.X.Y`` the shim (``gradscope/_torch.py``) reads at import is in the check's list."""
    import ast
    import pathlib

    import gradscope._torchcheck as check

    src = (pathlib.Path(_ROOT) / "gradscope" / "_torch.py").read_text(encoding="utf-8")
    read = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Attribute):
            parts, cur = [], node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "torch" and any(p.startswith("_") for p in parts):
                read.add(".".join(reversed(parts)))
    missing = {name for name in read if not any(r == name or r.startswith(name + ".") or name.startswith(r + ".")
                                                for r in check.REQUIRED)}
    missing -= {"autograd._engine_run_backward"}     # optional: watch() looks it up with a default
    assert not missing, f"add to _torchcheck.REQUIRED: {sorted(missing)}"
