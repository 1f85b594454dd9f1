"""Measuring in-node memory: every signature's backward in one torch.profiler session (NOTE [in-node memory]).

``measure(sigs)`` runs each signature's backward (``rebuild.prepare``) under a ``record_function`` marker
inside one profiler session with ``profile_memory=True``, and reads the marker's allocator events: the
highest point above what the backward leaves behind (its gradients) is the node's in-node memory. A
signature with a tensor above :data:`LIMIT` (a window op's, :func:`has_window`: above :data:`WINDOW_LIMIT`)
is measured at two smaller sizes (its large dimensions divided) and extrapolated in the total bytes of its
tensors: linearly, or with the power the two measurements show (at most 2), never below linear. The
profiler's own start/stop lines on stderr are silenced by pointing file descriptor 2 at the null device
for the two calls only, and restoring it.

When a torch.profiler is already running in this process (the user's), a second one cannot start: the
built-in ops are measured in a fresh Python process (``python -m gradscope.memory.kernels.measure``).
Custom Functions, whose classes live in this process, run on fake tensors here (``fake.py``: no profiler
needed), as they do by default.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import torch

from gradscope._torch import PROFILER_ALLOCATION, profiler_enabled
from gradscope._torchcheck import readable
from gradscope.memory.kernels.formula import is_formula, prepare_formula
from gradscope.memory.kernels.rebuild import SAME_FORMULA, Unmeasurable, prepare
from gradscope.memory.kernels.signature import tensors_of

__all__ = ["measure", "LIMIT", "WINDOW_LIMIT", "has_window", "quiet"]

#: A signature with a tensor larger than this is measured at smaller sizes and extrapolated.
LIMIT = 1024 * 1024
#: A window op's signature (a convolution's, a pooling's: :func:`has_window`) is measured at full size up
#: to this largest tensor: a shrunk copy is another problem for its kernel.
WINDOW_LIMIT = 64 * 1024 * 1024
#: Saved values that make an op a window op.
WINDOW = ("kernel_size", "stride", "dilation")


def has_window(sig: dict) -> bool:
    """Whether the node's op slides a window (a convolution, a pooling): its saved values hold one of
    :data:`WINDOW`. Dividing its sizes divides the window (the weight's spatial dimensions, the stride)
    with them, which is another problem for the kernel, not a smaller copy of this one: a ViT's patch
    embedding (kernel and stride 32) allocates 4x its weight in its backward at full size, and the
    extrapolation from a 8 and a 16 window said 16x (docs/memory.md, "In-node memory")."""
    attrs = sig.get("attrs") or {}
    return any(k in attrs for k in WINDOW)


_MARK = "gs::innode:"


def quiet(fn):
    """Call ``fn()`` with file descriptor 2 pointed at the null device (restored after, whatever happens)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        return fn()
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        return fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _nbytes(shape, dtype: str) -> int:
    dt = getattr(torch, dtype, torch.float32)
    size = dt.itemsize if isinstance(dt, torch.dtype) else 4
    return math.prod(int(n) for n in shape) * size


def _largest(sig: dict) -> int:
    return max((_nbytes(s, d) for s, d in tensors_of(sig)), default=0)


def _total(sig: dict) -> int:
    return sum(_nbytes(s, d) for s, d in tensors_of(sig))


def _restride(shape: list, stride) -> list | None:
    """Strides of the same dimension order for a new shape (zero strides stay zero)."""
    if not stride:
        return stride
    order = sorted(range(len(shape)), key=lambda i: (stride[i], i))
    out, acc = [0] * len(shape), 1
    for i in order:
        if stride[i] == 0:
            continue
        out[i] = acc
        acc *= max(int(shape[i]), 1)
    return out


def shrink(sig: dict, f: float) -> dict:
    """The signature with each large dimension size (>= 32) divided by ``f``, in every tensor and recorded
    size alike, so that sizes that must agree (a ``cat``'s pieces and its output, a slice's bounds) still do."""
    new = {int(n): max(1, math.ceil(int(n) / f)) for shape, _ in tensors_of(sig) for n in shape if int(n) >= 32}

    def sub(x):
        if isinstance(x, bool) or not isinstance(x, (int, list)):
            return x
        if isinstance(x, int):
            return new.get(x, x)
        return [sub(y) for y in x]

    out = dict(sig)
    out["saved"] = [[s[0], sub(s[1]), _restride(sub(s[1]), s[2]), s[3], s[4]] for s in sig["saved"]]
    out["inputs"] = [[i[0], sub(i[1]), i[2], _restride(sub(i[1]), i[3])] for i in sig["inputs"]]
    out["grads"] = [[g[0], sub(g[1]), _restride(sub(g[1]), g[2]), g[3]] for g in sig["grads"]]
    out["attrs"] = {k: sub(v) for k, v in sig["attrs"].items()}
    if "outs" in sig:  # a custom Function's output shapes (its unused outputs' zero gradients)
        out["outs"] = [[sub(o[0]), o[1]] for o in sig["outs"]]
    return out


_EVAL = "autograd::engine::evaluate_function: "


def one_thread(fn, *args):
    """``fn(*args)`` on one intra-op thread, the count restored after: building a node's inputs is not what
    is measured, and on a loaded machine each parallel region of a small op costs a scheduling wait (a
    session took four times as long with two threads). The backward itself runs on the caller's threads,
    which the signature records."""
    n = torch.get_num_threads()
    if n == 1:
        return fn(*args)
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(n)


def _window(marker, op: str | None):
    """The event whose allocations are the node's: its ``evaluate_function`` under the marker (a built-in
    node; the gradient it receives was made before it), or the marker itself (a custom backward, called
    directly)."""
    if op is None:
        return marker
    stack = list(marker.children)
    while stack:
        n = stack.pop()
        if n.name == _EVAL + op:
            return n
        stack.extend(n.children)
    return None


def _in_node(window, returned: set) -> int:
    """The highest running sum of the window's allocator events, minus the blocks it allocated that it
    returned (the gradients it sends on, which the replay counts as the node's outputs)."""
    events, sub = [], [window]
    while sub:
        n = sub.pop()
        if n.typed[0] == PROFILER_ALLOCATION:
            e = n.typed[1]
            events.append((n.start_time_ns, int(e.alloc_size), int(e.ptr)))
        sub.extend(n.children)
    run = high = 0
    live: dict = {}
    for _, b, ptr in sorted(events):
        run += b
        high = max(high, run)
        if b > 0:
            live[ptr] = b
        else:
            live.pop(ptr, None)
    return max(0, high - sum(b for ptr, b in live.items() if ptr in returned))


def _returned(got) -> set:
    """Data pointers of the storages of the tensors a backward returned."""
    out = set()
    for t in got if isinstance(got, (tuple, list)) else (got,):
        if isinstance(t, torch.Tensor):
            out.add(t.untyped_storage().data_ptr())
    return out


def _markers(tree) -> dict:
    out, stack = {}, list(tree)
    while stack:
        node = stack.pop()
        if node.name.startswith(_MARK):
            out[int(node.name[len(_MARK) :])] = node
        else:
            stack.extend(node.children)
    return out


def _session(jobs: list, run_custom: bool) -> dict:
    """Run every job ``(index, signature)`` in one profiler session: ``{index: bytes or reason}``."""
    from torch.autograd.profiler import profile, record_function

    unread = quiet(lambda: readable("profiler-events"))  # the event names and tags read below
    if unread is not None:
        return {i: unread for i, _ in jobs}
    results: dict = {}
    info: dict = {}  # index -> (the node's name or None for a direct call, returned data pointers)
    warm: set = set()
    # torch.autograd.profiler's session: torch.profiler.profile would import torch._inductor (seconds)
    prof = profile(profile_memory=True, use_kineto=True)
    quiet(prof.__enter__)
    try:
        for i, sig in jobs:
            try:
                make = prepare_formula if is_formula(sig) else lambda s: prepare(s, run_custom)
                if sig["op"] not in warm:  # a first run sets up what a kernel sets up once per process
                    warm.add(sig["op"])
                    one_thread(make, sig)()
                run = one_thread(make, sig)
                with record_function(f"{_MARK}{i}"):
                    got = run()
                op = SAME_FORMULA.get(sig["op"], sig["op"])  # the node the rebuild made
                info[i] = (None if getattr(run, "direct", False) else op, _returned(got))
                del got, run
            except Unmeasurable as e:
                results[i] = str(e)
            except Exception as e:  # noqa: BLE001 - a kernel refusing the rebuilt tensors: not measured
                results[i] = f"{sig['op']} failed on random tensors: {str(e).splitlines()[0][:160] if str(e) else e!r}"
    finally:
        quiet(lambda: prof.__exit__(None, None, None))
    results_of = prof.kineto_results
    markers = _markers(results_of.experimental_event_tree() if results_of is not None else [])
    for i, (op, returned) in info.items():
        window = _window(markers[i], op) if i in markers else None
        results[i] = "the profiler recorded no such node" if window is None else _in_node(window, returned)
    return results


def _plan(sig: dict) -> list:
    """The signatures to run for ``sig``: itself, or two shrunk copies when a tensor exceeds LIMIT (the
    largest tensor at most LIMIT/2, then its large dimensions doubled: sizes near LIMIT, where kernels
    choose the algorithm they choose at full size more often than at tiny ones)."""
    top = _largest(sig)
    if top <= LIMIT or is_formula(sig):  # a recorded formula's sizes are in its calls too: full size
        return [sig]
    if top <= WINDOW_LIMIT and has_window(sig):
        return [sig]
    f = 2.0
    small = shrink(sig, f)
    if _largest(small) >= top:  # no large dimension to divide: measured as it is
        return [sig]
    while _largest(small) > LIMIT // 2 and f < 2**24:
        f *= 2
        small = shrink(sig, f)
    return [small, shrink(sig, f / 2)]


def _fit(sig: dict, runs: list, got: list) -> dict:
    if any(isinstance(g, str) for g in got):
        return {"error": next(g for g in got if isinstance(g, str))}
    if len(runs) == 1:
        return {"bytes": int(got[0])}
    (s1, s2), (w1, w2) = (_total(r) for r in runs), got
    if w2 <= 0:
        return {"bytes": 0, "extrapolated": True}
    p = 1.0
    if w1 > 0 and s2 > s1:
        p = min(2.0, max(1.0, math.log(w2 / w1) / math.log(s2 / s1)))
    return {"bytes": int(w2 * (_total(sig) / s2) ** p), "extrapolated": True, "power": round(p, 2)}


def _local(sigs: list, run_custom: bool) -> list:
    runs = [_plan(s) for s in sigs]
    jobs = [(j, r) for j, r in enumerate(x for rs in runs for x in rs)]
    res = _session(jobs, run_custom) if jobs else {}
    out, j = [], 0
    for sig, rs in zip(sigs, runs):
        got = [res.get(j + n, "no measurement was recorded") for n in range(len(rs))]
        j += len(rs)
        out.append(_fit(sig, rs, got))
    return out


def _remote(sigs: list) -> list:
    """Measure built-in ops in a fresh Python process (a profiler is running in this one)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    payload = json.dumps({"threads": torch.get_num_threads(), "sigs": sigs})
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gradscope.memory.kernels.measure"],
            input=payload,
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError) as e:
        return [{"error": f"measuring in a separate process failed ({e})"} for _ in sigs]


def measure(sigs: list, run_custom: bool = False) -> tuple[list, bool]:
    """``([{"bytes": n} or {"error": reason}] per signature, measured_elsewhere)``.

    A custom Function's backward runs on fake tensors (``fake.py``) unless ``run_custom``; with it, on real
    random tensors in this process's profiler session (``"how"`` says which). Under a running torch.profiler
    the built-in ops go to a fresh process (``measured_elsewhere`` is then True) and custom Functions run on
    fake tensors (a second profiler session cannot start here).
    """
    from gradscope.memory.kernels.fake import REAL, measure_fake

    out: list = [None] * len(sigs)
    elsewhere = profiler_enabled()
    real = [i for i, s in enumerate(sigs) if not s.get("function") or (run_custom and not elsewhere)]
    for i, s in enumerate(sigs):
        if s.get("function") and i not in real:
            out[i] = measure_fake(s)
    if real and not elsewhere:
        for i, r in zip(real, _local([sigs[i] for i in real], run_custom)):
            out[i] = {**r, "how": REAL} if sigs[i].get("function") and "error" not in r else r
    elif real:
        for i, r in zip(real, _remote([sigs[i] for i in real])):
            out[i] = r
    return out, elsewhere and bool(real)


def _main() -> None:
    data = json.loads(sys.stdin.read())
    torch.set_num_threads(int(data.get("threads") or torch.get_num_threads()))
    print(json.dumps(_local(data["sigs"], False)))


if __name__ == "__main__":
    _main()
