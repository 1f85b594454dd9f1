"""The public API is typed: every parameter and the return value of the entry points carry an annotation."""

from __future__ import annotations

import inspect as pyinspect

import pytest

import gradscope
from gradscope.memory.sharding.specs import DDP, FSDP
from gradscope.report import Report
from gradscope.views import render
from gradscope.watching.guard import Watch

PUBLIC = [
    gradscope.inspect,
    gradscope.trace,
    gradscope.load,
    gradscope.diff,
    gradscope.watch,  # Watch's constructor: Watch(...) is built only by watch(), from its typed arguments
    Watch.remove,
    Watch.flow_svg,
    Watch.__exit__,
    *(getattr(Report, name) for name in (
        "summary", "explain", "memory", "backward_memory", "what_if", "plan", "max_batch", "render", "to_dot",
        "to_json", "from_json", "load", "peek_graph", "__init__",
    )),
    render.render,  # the views' entry points take the report as a ReportLike (views never import Report)
    render.to_dot,
    # the sharding specs (dataclasses: their fields are the constructor's parameters)
    pytest.param(DDP.__init__, id="DDP.__init__"),
    DDP.label,
    DDP.code,
    pytest.param(FSDP.__init__, id="FSDP.__init__"),
    FSDP.label,
    FSDP.code,
    FSDP.reshard_size.fget,
]  # fmt: skip


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda f: f.__qualname__)
def test_signature_is_annotated(fn):
    sig = pyinspect.signature(fn)
    bare = [p.name for p in sig.parameters.values() if p.name not in ("self", "cls") and p.annotation is p.empty]
    assert not bare, f"{fn.__qualname__}: parameters without a type: {bare}"
    assert sig.return_annotation is not sig.empty, f"{fn.__qualname__} has no return type"
