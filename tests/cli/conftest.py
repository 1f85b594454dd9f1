"""The training script the ``gradscope memory`` tests point at, and the command itself."""

from __future__ import annotations

import textwrap

import pytest
from click.testing import CliRunner

from gradscope.cli.commands import main


@pytest.fixture()
def target(request, tmp_path, monkeypatch):
    """The test module's ``_TARGET`` source written to ``train.py``, with a cache folder of its own."""
    monkeypatch.setenv("GRADSCOPE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(request.module._TARGET))
    return str(path)


def run_memory(*args):
    """``gradscope memory *args`` in this process."""
    return CliRunner().invoke(main, ["memory", *args])
