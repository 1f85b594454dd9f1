"""The examples in gradscope's docstrings run and print what they say (doctest).

Every module of the package is searched; an example marked ``# doctest: +SKIP`` is only an illustration
(it needs a model the reader has). Modules listed in PUBLIC must keep at least one runnable example.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import gradscope

#: Modules behind the public API at a glance (README): each must have a running example.
PUBLIC = ("gradscope.inspection", "gradscope.tracing.recorder", "gradscope.watching.guard", "gradscope.views.render",
          "gradscope.graph")

MODULES = sorted(m.name for m in pkgutil.walk_packages(gradscope.__path__, "gradscope.")) + ["gradscope"]


def _run(name: str) -> doctest.TestResults:
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name, globs={**vars(module)}):
        runner.run(test)
    return runner.summarize(verbose=False)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    failed, attempted = _run(name)
    assert failed == 0, f"{failed} of {attempted} docstring examples in {name} fail (see the output above)"
    if name in PUBLIC:
        assert attempted > 0, f"{name} has no runnable docstring example"
