"""Releasing the Python wrappers of a very deep autograd graph without overflowing the C stack.

NOTE [freeing deep graphs]
Reading ``next_functions`` creates a Python wrapper for every node, and torch 2.13 keeps each wrapper
alive for as long as its C++ node lives. Once wrappers exist along a chain of ~30k+ nodes, dropping the
loss frees the chain recursively and overflows the C stack (TORCH-FACTS section 11). Without wrappers
the C++ deleter is iterative and safe.

What works: keep the walker's references in discovery (root-first) order until every root tensor is
gone, then drop them root-first, so each release frees exactly one node. A weakref callback on the root
runs too early (the dying tensor still holds the root node while its callbacks run), so the callback only
hands the list to a releaser thread; that thread waits until the tensor's deallocation has finished and
releases on a 256 MiB stack, where even an unlucky order cannot overflow. An atexit hook finishes any
pending release before interpreter shutdown (a thread still freeing at exit aborts the process).

Nothing is kept alive that the roots did not already keep alive: the references are dropped as soon
as the last root dies.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref

__all__ = ["keep_until_dead", "pending"]

_STACK = 256 * 1024 * 1024
_queue: queue.Queue = queue.Queue()
_lock = threading.Lock()
_worker: threading.Thread | None = None
_held: dict[int, list] = {}   # token -> node list still waiting for its roots to die


def pending() -> int:
    """Number of node lists still held (waiting for their roots to die, or being released)."""
    return len(_held) + _queue.unfinished_tasks


def keep_until_dead(roots, nodes: list) -> None:
    """Hold ``nodes`` (root-first) until every tensor in ``roots`` is gone, then release them safely."""
    token = id(nodes)
    _held[token] = nodes
    alive = [len(roots)]

    def _dead() -> None:
        alive[0] -= 1
        if alive[0] == 0:
            _ensure_worker()
            _queue.put(_held.pop(token, None))

    for t in roots:
        f = weakref.finalize(t, _dead)
        f.atexit = False


def _ensure_worker() -> None:
    global _worker
    with _lock:
        if _worker is not None and _worker.is_alive():
            return
        old = threading.stack_size()
        threading.stack_size(_STACK)
        try:
            _worker = threading.Thread(target=_run, name="gradscope-release", daemon=True)
            _worker.start()
        finally:
            threading.stack_size(old)


def _run() -> None:
    while True:
        nodes = _queue.get()
        try:
            if nodes is None:
                continue
            # The weakref callback that queued us ran inside the tensor's deallocation; give the
            # owning thread time to finish it before the first release.
            time.sleep(0.05)
            nodes.reverse()
            while nodes:
                nodes.pop()
            del nodes
        finally:
            _queue.task_done()


@atexit.register
def _drain() -> None:
    # Finish releases already queued. Lists whose roots are still alive at exit are released here,
    # root-first, on the big-stack thread; the roots' own teardown then frees nodes one at a time.
    if _held:
        _ensure_worker()
        for token in list(_held):
            _queue.put(_held.pop(token))
    _queue.join()
