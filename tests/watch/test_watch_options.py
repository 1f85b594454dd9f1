"""watch()'s options: one frozen WatchOptions, checked once; watch()'s keywords are its fields."""

from __future__ import annotations

import dataclasses
import inspect as pyinspect

import pytest
import torch
from torch import nn

import gradscope
from gradscope.watching.guard import Watch
from gradscope.watching.options import WatchOptions


def test_watchs_keywords_are_the_options_fields_with_the_same_defaults():
    sig = pyinspect.signature(gradscope.watch)
    keywords = {n: p.default for n, p in sig.parameters.items() if n != "model"}
    fields = {f.name: f.default for f in dataclasses.fields(WatchOptions)}
    assert keywords == fields
    assert all(p.kind is p.KEYWORD_ONLY for n, p in sig.parameters.items() if n != "model")


def test_the_guard_keeps_its_options_frozen():
    model = nn.Linear(4, 1)
    with gradscope.watch(model, every=3, ignore="bias", graphs=False) as guard:
        assert guard.options == WatchOptions(every=3, ignore=("bias",), graphs=False)
        with pytest.raises(dataclasses.FrozenInstanceError):
            guard.options.every = 1  # type: ignore[misc]
        assert "every=3" in repr(guard) and "ignore=['bias']" in repr(guard) and "graphs=False" in repr(guard)
        model(torch.randn(2, 4)).sum().backward()
    assert guard.backwards == 1


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (dict(every=0), gradscope.InputValueError, "every must be a positive int, got 0"),
        (dict(accumulate=True), gradscope.InputValueError, "accumulate must be a positive int"),
        (dict(history=-1), gradscope.InputValueError, "history must be a non-negative int"),
        (dict(ratio_every=1.5), gradscope.InputValueError, "ratio_every must be a positive int"),
        (dict(vanishing="small"), gradscope.InputValueError, "vanishing must be a non-negative number"),
        (dict(exploding=-1.0), gradscope.InputValueError, "exploding must be a non-negative number"),
        (dict(on_error="ignore"), gradscope.InputValueError, "on_error must be 'raise', 'warn' or a callable"),
        (dict(ignore=3), gradscope.InputTypeError, "ignore must be a name, a pattern or a list"),
        (dict(ignore=["a", 3]), gradscope.InputTypeError, "ignore must hold parameter names"),
        (dict(scaler=object()), gradscope.InputTypeError, "scaler must be a torch.amp.GradScaler"),
        (dict(optimizer="adam"), gradscope.InputTypeError, "optimizer must be a torch.optim.Optimizer"),
    ],
)
def test_a_bad_option_is_one_sentence_from_watch_and_from_the_options(kwargs, error, words):
    model = nn.Linear(4, 1)
    for build in (lambda: gradscope.watch(model, **kwargs), lambda: WatchOptions(**kwargs)):
        with pytest.raises(error, match=words) as exc:
            build()
        assert str(exc.value).count(". ") == 0 and str(exc.value).endswith(".")
    assert model._forward_hooks == {} and model.weight._backward_hooks in (None, {})


def test_an_unknown_option_names_the_options():
    with pytest.raises(gradscope.InputTypeError, match="unknown watch option 'evry'; the options are on_error, "):
        WatchOptions.of(evry=2)
    assert WatchOptions.of(every=2).every == 2


def test_the_model_is_checked_before_the_options():
    with pytest.raises(gradscope.InputTypeError, match="watch\\(\\) needs a torch.nn.Module"):
        gradscope.watch(torch.zeros(2), every=0)
    with pytest.raises(gradscope.InputTypeError, match="takes a WatchOptions"):
        Watch(nn.Linear(2, 1), {"every": 2})  # type: ignore[arg-type]
