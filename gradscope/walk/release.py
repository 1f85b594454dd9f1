"""Releasing the Python wrappers of a very deep autograd graph without overflowing the C stack.

NOTE [freeing deep graphs]
Reading ``next_functions`` creates a Python wrapper for every node, and torch 2.13 keeps each wrapper
alive for as long as its C++ node lives. Once wrappers exist along a chain of ~30k+ nodes, freeing the
chain goes through each wrapper's deallocation in turn, recursively, and overflows the C stack
(docs/internals.md#freeing-deep-graphs), whoever drops the last reference: the loss, a later tensor that consumed it
(``y = loss * 2``), or an activation kept from the middle of the chain. Without wrappers the C++ deleter
is iterative and safe.

What we do: hold a strong reference to every wrapper the walk created, in discovery (root-first) order.
While we hold them, no drop by the user can free more than the nodes we do not hold, so nothing recurses.
A wrapper's reference count tells whether anything besides our reference still owns its node: torch
adds one reference to a wrapper exactly while the C++ node has an owner other than the wrapper (a
tensor's ``grad_fn``, a consumer node's edge). A node whose wrapper shows only our reference is dead
for everyone else; releasing it frees exactly that node, because its inputs are still held by us. So a
releaser thread (on a 256 MiB stack, to be safe in any order) scans each held list root-first and
releases such nodes, again until a scan makes no progress (each node is held by one list only, so two
inspections of one graph cannot keep each other's nodes alive); a node some tensor still owns stays held
until that owner dies, and then goes the same way. The scan is skipped while every root node is owned
(then every node is). A weakref finalizer on each root tensor wakes the thread at once; otherwise it
polls with a backoff (50 ms to 1 s), so memory is returned shortly after torch alone would return it.

At interpreter exit the thread is stopped and joined (a thread still freeing at exit aborts the
process), one last scan runs in the main thread, and what is still owned by the user's objects is left
alive on purpose (never freed during finalization, when the recursion would crash).
"""

from __future__ import annotations

import atexit
import ctypes
import sys
import threading
import weakref

__all__ = ["keep_until_dead", "pending"]

_STACK = 256 * 1024 * 1024
_MIN_WAIT, _MAX_WAIT = 0.05, 1.0
_lock = threading.Lock()
_wake = threading.Event()
_held: list[list] = []  # [head nodes, root-first node list] per held graph
_ids: set[int] = set()  # id() of every node held, in whichever list
_worker: threading.Thread | None = None
_stopping = False
_getrefcount = sys.getrefcount


def _calibrate() -> int:
    probe = [object()]
    return _getrefcount(probe[0])  # a list entry read as `_getrefcount(lst[i])`: ours only


_ONLY_OURS = _calibrate()


def pending() -> int:
    """Number of node lists still held (some node of theirs is still owned outside gradscope)."""
    with _lock:
        return len(_held)


def keep_until_dead(roots, nodes: list) -> None:
    """Hold ``nodes`` (root-first) until nothing else owns them, then release them one node at a time.

    ``roots``: the tensors whose ``grad_fn`` the walk started from; their nodes are checked first, and
    their finalizers wake the releaser.
    """
    with _lock:  # each node is held once, by the first list that met it (two inspects of one graph)
        nodes = [n for n in nodes if id(n) not in _ids]
        _ids.update(id(n) for n in nodes)
    if not nodes:
        return
    known = {id(n) for n in nodes}
    heads = []
    for t in roots:
        node = getattr(t, "grad_fn", None)
        if node is not None and id(node) in known:  # counted below as held twice
            heads.append(node)
    del known
    entry = [heads if len(heads) == len(roots) else [], nodes]
    with _lock:
        _held.append(entry)
    for t in roots:
        try:
            f = weakref.finalize(t, _wake.set)
            f.atexit = False
        except TypeError:
            pass
    _ensure_worker()
    _wake.set()


def _ensure_worker() -> None:
    global _worker
    with _lock:
        if _stopping or (_worker is not None and _worker.is_alive()):
            return
        old = threading.stack_size()
        threading.stack_size(_STACK)
        try:
            _worker = threading.Thread(target=_run, name="gradscope-release", daemon=True)
            _worker.start()
        finally:
            threading.stack_size(old)


def _release(entry: list) -> bool:
    """Release the nodes of ``entry`` that only we own; True when the whole entry is gone."""
    heads, nodes = entry
    if heads:
        for i in range(len(heads)):
            if _getrefcount(heads[i]) <= _ONLY_OURS + 1:  # heads and nodes both hold it
                break
        else:
            return False  # every root node is owned elsewhere, hence every node
        heads.clear()
    while True:
        keep = []
        freed = 0
        for i in range(len(nodes)):
            if _getrefcount(nodes[i]) <= _ONLY_OURS:
                _ids.discard(id(nodes[i]))
                nodes[i] = None  # frees exactly this node: its inputs are still held
                freed += 1
            else:
                keep.append(i)
        if freed == 0 or not keep:
            break
        nodes[:] = [nodes[i] for i in keep]
    if all(n is None for n in nodes):
        nodes.clear()
        return True
    nodes[:] = [n for n in nodes if n is not None]
    return False


def _scan() -> bool:
    """One pass over every held list; True when something is still held."""
    with _lock:
        entries = list(_held)
    done = [e for e in entries if _release(e)]
    with _lock:
        for e in done:
            _held.remove(e)
        return bool(_held)


def _run() -> None:
    wait = _MIN_WAIT
    while not _stopping:
        woken = _wake.wait(wait)
        _wake.clear()
        if _stopping:
            break
        before = pending()
        busy = _scan()
        if not busy:
            wait = _MIN_WAIT
            _wake.wait()  # nothing held: sleep until the next keep_until_dead or finalizer
            continue
        wait = _MIN_WAIT if (woken or pending() < before) else min(wait * 2, _MAX_WAIT)


@atexit.register
def _drain() -> None:
    global _stopping
    with _lock:
        _stopping = True
    _wake.set()
    if _worker is not None:
        _worker.join()
    _scan()
    with _lock:
        left = list(_held)
    for entry in left:  # still owned by the user's objects: never free them during finalization
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(entry))
