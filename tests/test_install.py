"""How gradscope installs: beside the user's torch (setup.cfg's range), and `make demo` without a browser."""

from __future__ import annotations

import configparser
import pathlib
import shutil
import subprocess

import pytest
import torch
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _requirements() -> dict:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = [ln.strip() for ln in cfg["options"]["install_requires"].splitlines()]
    reqs = [Requirement(ln) for ln in lines if ln and not ln.startswith("#")]
    return {r.name: r for r in reqs}


def test_setup_cfg_admits_this_torch_and_later_ones():
    """``pip install gradscope`` into a project on torch 2.13 or later keeps that torch: the range has no
    upper pin (an unsupported torch is refused at import instead, tests/walk/test_torch_support.py)."""
    spec = _requirements()["torch"].specifier
    here = torch.__version__.split("+")[0]
    for version in (here, "2.13.0", "2.13.1", "2.14.1", "2.15.0", "3.0.0"):
        assert spec.contains(version), (str(spec), version)
    assert not spec.contains("2.12.1")


def _dry(target: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    done = subprocess.run(["make", "-n", target, "VENV=/nonexistent-venv"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_demo_needs_graphviz_but_no_browser():
    demo = _dry("demo")
    assert "graphviz" in demo and "gradscope demo" in demo
    assert "chromium" not in demo


def test_make_test_installs_the_browser_for_the_viewer_tests():
    assert "chromium" in _dry("test")


def test_the_makefile_pins_the_cpu_wheel():
    assert "torch==2.13.0" in (ROOT / "Makefile").read_text()
