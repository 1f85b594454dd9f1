"""Small models several test files share: layers from a table, and the docs' example scripts as modules.

A model written as a :class:`Linears` subclass states only its layers (a table, created in its order, so a seed
draws the same weights as the ``__init__`` it replaces) and its ``forward``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from torch import nn

DOCS = Path(__file__).resolve().parents[1] / "docs"


class Linears(nn.Module):
    """``nn.Linear`` layers from the class's ``LAYERS`` table, ``{name: (in, out)}`` or ``(in, out, bias)``."""

    LAYERS: dict[str, tuple] = {}

    def __init__(self):
        super().__init__()
        for name, shape in self.LAYERS.items():
            setattr(self, name, nn.Linear(*shape))


class TwoTasks(Linears):
    """A trunk and two task heads, both used by every forward."""

    LAYERS = {"trunk": (4, 8), "task1": (8, 1), "task2": (8, 1)}

    def forward(self, x):
        h = self.trunk(x).relu()
        return self.task1(h), self.task2(h)


def docs_example(name: str) -> ModuleType:
    """``docs/{name}.py`` imported as a module (once), so that a test runs what the docs show."""
    key = f"_docs_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, DOCS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[key] = module
    return sys.modules[key]
