"""Every private torch API the guard uses, in one place (so it can move to ``gradscope._torch``).

- the autograd engine's graph-task id, current node and end-of-backward callback queue;
- the thread-local sequence-number counter (creation order of autograd nodes);
- anomaly mode's traceback recording, switched on for one armed step only;
- a one-shot wrapper around ``torch.autograd._engine_run_backward`` that hands the roots of the *next*
  backward to a callback, then unwraps itself (used only after a non-finite step; see
  NOTE [armed backward] in :mod:`gradscope.watching.origin`).
"""

from __future__ import annotations

import torch
import torch.autograd as _autograd

__all__ = ["task_id", "current_node", "queue_callback", "peek_seq", "anomaly_state", "set_anomaly",
           "on_next_backward", "cancel_next_backward"]

task_id = torch._C._current_graph_task_id
current_node = torch._C._current_autograd_node
peek_seq = torch._C._autograd._get_sequence_nr


def queue_callback(fn) -> None:
    """Run ``fn`` once the running backward has finished (what DDP's reducer uses)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def anomaly_state() -> tuple[bool, bool]:
    return torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()


def set_anomaly(state: tuple[bool, bool]) -> None:
    """Set anomaly mode without the Python context manager (no warning, no stack): used to record
    forward tracebacks in ``node.metadata['traceback_']`` on one armed step, with ``check_nan`` off."""
    torch.set_anomaly_enabled(*state)


_waiting: list = []          # callbacks for the next backward's roots
_installed: list = []        # [(wrapper, the function it replaced)] while wrapped


def _make_wrapper(original):
    def run_backward(t_outputs, *args, **kwargs):
        _unwrap()
        for fn in _waiting[:]:
            _waiting.remove(fn)
            try:
                fn(t_outputs)
            except Exception:    # noqa: BLE001 - diagnostics must never break the user's backward
                pass
        return original(t_outputs, *args, **kwargs)
    return run_backward


def _unwrap() -> None:
    while _installed:
        wrapper, original = _installed.pop()
        if _autograd._engine_run_backward is wrapper:   # else someone wrapped over us: stay a pass-through
            _autograd._engine_run_backward = original


def on_next_backward(fn) -> None:
    """Call ``fn(roots)`` at the start of the next ``backward()``/``autograd.grad`` on any thread."""
    if fn not in _waiting:
        _waiting.append(fn)
    if not _installed and getattr(_autograd, "_engine_run_backward", None) is not None:
        wrapper = _make_wrapper(_autograd._engine_run_backward)
        _installed.append((wrapper, _autograd._engine_run_backward))
        _autograd._engine_run_backward = wrapper


def cancel_next_backward(fn) -> None:
    if fn in _waiting:
        _waiting.remove(fn)
    if not _waiting:
        _unwrap()
