"""The workspace of one aten call of a compiled region's backward graph: the call run alone on fresh CPU
tensors of the recorded layouts, under the profiler (NOTE [compiled region memory] in walk/regionmem.py).

A call is measured as a one-call recorded formula (``formula.py``): its highest point minus the outputs it
returns is the bytes the kernel allocates and frees inside (an ``mm`` none, ``convolution_backward`` its
column buffers). Results are kept per call signature (in this process and in the in-node cache file);
a call that cannot be measured (not an aten operator here, a tensor above the formula limit) has none, and
its region is then a lower bound.
"""

from __future__ import annotations

import json

from gradscope.memory.kernels.measure import measure
from gradscope.memory.kernels.workspace import cache_entries, save_cache

__all__ = ["call_workspaces"]

_PREFIX = "fxcall:"


def _signature(call: list) -> dict:
    op, args, kwargs, specs, n_out = call
    first = specs[0] if specs else ["hidden[0]", [1], [1], "float32"]
    return {
        "op": op,
        "attrs": {"formula": {"calls": [[op, args, kwargs]], "hidden": len(specs), "out": _outs(n_out)}},
        "saved": specs,
        "grads": [[0, first[1], first[2], first[3]]],
        "inputs": [],
    }


def _outs(n: int) -> list:
    return [{"t": "v", "i": 0, "j": j} for j in range(n)]  # every output the call returns


def call_workspaces(calls: list) -> tuple[list, dict]:
    """``(bytes or None per call, {call index: why not measured})`` for ``[op, args, kwargs, specs, outputs]`` calls."""
    memo = cache_entries()
    keys = [_PREFIX + json.dumps(c, sort_keys=True) for c in calls]
    todo = {}
    for i, k in enumerate(keys):
        if k not in memo and k not in todo:
            todo[k] = calls[i]
    if todo:
        got, _ = measure([_signature(c) for c in todo.values()])
        wrote = False
        for k, r in zip(todo, got):
            if "error" not in r:
                memo[k] = r
                wrote = True
            else:
                _FAILED[k] = r["error"]
        if wrote:
            save_cache()
    out: list[int | None] = []
    why: dict = {}
    for i, k in enumerate(keys):
        r = memo.get(k)
        if r is None:
            out.append(None)
            why[i] = _FAILED.get(k, "not measured")
        else:
            out.append(int(r.get("bytes", 0)))
    return out, why


_FAILED: dict = {}  # failures, for this process only (never written)
