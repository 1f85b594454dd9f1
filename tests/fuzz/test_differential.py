"""Differential fuzzing: gradscope's predictions vs what torch's backward() does (see ``_oracle``)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ._oracle import check_program
from ._program import programs, programs_slow
from ._vocab import TORCH_OPS

_COMMON = dict(deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much])
_CI = int(os.environ.get("GRADSCOPE_FUZZ_CI", 150))
settings.register_profile("gradscope-fuzz-ci", max_examples=_CI, derandomize=True, **_COMMON)
settings.register_profile("gradscope-fuzz-ci-traced", max_examples=max(1, _CI // 2), derandomize=True,
                          **_COMMON)
settings.register_profile("gradscope-fuzz-slow",
                          max_examples=int(os.environ.get("GRADSCOPE_FUZZ_SLOW", 5000)), **_COMMON)


def test_vocabulary_is_large_enough():
    assert len(TORCH_OPS) >= 40


@settings(settings.get_profile("gradscope-fuzz-ci"))
@given(programs)
def test_predictions_match_torch(prog):
    check_program(prog)


@settings(settings.get_profile("gradscope-fuzz-ci-traced"))
@given(programs)
def test_predictions_match_torch_traced_and_watched(prog):
    check_program(prog, traced=True, watched=True)


@pytest.mark.slow
@settings(settings.get_profile("gradscope-fuzz-slow"))
@given(programs_slow, st.booleans(), st.booleans())
def test_predictions_match_torch_slow(prog, traced, watched):
    check_program(prog, traced=traced, watched=watched)
