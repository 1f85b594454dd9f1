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


def test_setup_cfg_admits_the_tested_releases_only():
    """``pip install gradscope`` into a project on torch 2.13, 2.14 or 2.15 keeps that torch: the range
    declares the releases the suite passes on (docs/verification.md#torch-releases), and no later one."""
    spec = _requirements()["torch"].specifier
    here = torch.__version__.split("+")[0]
    for version in (here, "2.13.0", "2.13.1", "2.14.1", "2.15.0", "2.15.3"):
        assert spec.contains(version), (str(spec), version)
    for version in ("2.12.1", "2.16.0", "3.0.0"):
        assert not spec.contains(version), (str(spec), version)


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


def test_make_test_torch_builds_its_venv_outside_the_checkout_and_is_not_in_make_test():
    """`make test-torch TORCH=X` installs torch==X (2.15.0 with the machine's pip configuration off, above
    its cap) into a venv under ~/.cache, runs the suite there with this checkout first on the path, and
    refuses a venv holding another torch; `make test` never builds or runs it."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")

    def dry(*args: str) -> str:
        done = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    venv = "/nonexistent-torch-venv"
    out = dry("test-torch", "TORCH=2.15.0", f"TORCH_VENV={venv}")
    assert f"-m venv {venv}" in out
    assert f"PIP_CONFIG_FILE=/dev/null {venv}/bin/pip install -q --disable-pip-version-check torch==2.15.0" in out
    assert "'networkx>=3.0'" in out and "'pytest>=7'" in out and " -e " not in out  # the checkout is not installed
    assert f"PYTHONPATH={ROOT} {venv}/bin/python -m pytest" in out
    assert "not 2.15.0" in out  # the torch check before the run
    older = dry("test-torch", "TORCH=2.14.1", f"TORCH_VENV={venv}")
    assert f"{venv}/bin/pip install -q --disable-pip-version-check torch==2.14.1" in older
    assert "PIP_CONFIG_FILE" not in older
    default = dry("test-torch", "TORCH=2.14.1")
    assert str(pathlib.Path.home() / ".cache" / "gradscope-torch" / "2.14.1") in default
    assert not str(pathlib.Path.home() / ".cache").startswith(str(ROOT))
    plain = dry("test", "VENV=/nonexistent-venv")
    assert "gradscope-torch" not in plain and "2.15" not in plain and "torch==2.13.0" in plain
