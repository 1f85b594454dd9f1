"""One answer to "is this frame the user's" (gradscope/_frames.py) for trace(), watch() and the CLI.

gradscope/demo.py is example user code: its lines are the user's everywhere; the rest of gradscope and
torch are not. The three places once disagreed on it.
"""

from __future__ import annotations

import os

import gradscope.demo
from gradscope._frames import user_caller
from gradscope.cli.target import _user_frame as cli_user_frame
from gradscope.tracing.probes import user_location
from gradscope.watching.holders import user_frame as watch_user_frame

DEMO = gradscope.demo.__file__
INSIDE = os.path.join(os.path.dirname(DEMO), "report.py")  # any other gradscope file


def _run_as(filename: str, src: str) -> dict:
    ns = {"user_caller": user_caller, "watch_user_frame": watch_user_frame, "user_location": user_location}
    exec(compile(src, filename, "exec"), ns)
    return ns


SRC = "f = user_caller(1)\nw = watch_user_frame(1)\nloc = user_location(0)\n"


def test_a_demo_frame_is_the_users_for_trace_and_watch():
    ns = _run_as(DEMO, SRC)
    assert ns["f"].f_code.co_filename == DEMO and ns["w"].f_code.co_filename == DEMO
    assert ns["loc"] == "demo.py:3"


def test_a_gradscope_frame_is_skipped_for_the_callers_frame():
    ns = _run_as(INSIDE, SRC)
    assert ns["f"].f_code.co_filename == __file__ and ns["w"].f_code.co_filename == __file__
    assert ns["loc"].startswith("test_frames.py:")


def test_the_cli_names_the_line_in_demo_py():
    try:
        _run_as(DEMO, "x = 1\nraise ValueError('planted')\n")
    except ValueError as exc:
        where = cli_user_frame(exc)
    assert where is not None and where.endswith("demo.py:2")
