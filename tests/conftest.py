"""Shared fixtures and the --slow switch."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="run slow profiles (fuzzing with thousands of examples, big graphs)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running; run with --slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow profile: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def module_cache_dir(tmp_path_factory):
    """GRADSCOPE_CACHE pointed at a fresh folder for one test module (its in-node measurements are its own)."""
    old = os.environ.get("GRADSCOPE_CACHE")
    os.environ["GRADSCOPE_CACHE"] = str(tmp_path_factory.mktemp("gs-cache"))
    yield
    if old is None:
        os.environ.pop("GRADSCOPE_CACHE", None)
    else:
        os.environ["GRADSCOPE_CACHE"] = old


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def grads_none(model: torch.nn.Module) -> set[str]:
    """Ground truth from torch: names of trainable parameters whose .grad is None."""
    return {n for n, p in model.named_parameters() if p.requires_grad and p.grad is None}
