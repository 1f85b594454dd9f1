"""Render time to SVG: gradscope's default (auto-collapsed) and fully expanded views against torchviz.

Each measurement runs in its own process (same machine, same run), after the model's forward pass:

* ``default``   ``gradscope.inspect(loss, model=m).render("x.svg")``
* ``expanded``  the same with ``collapse=False`` (every node drawn)
* ``torchviz``  ``torchviz.make_dot(loss, params=dict(m.named_parameters())).render(format="svg")``

A measurement that passes ``--timeout`` seconds (default 60) is stopped (its ``dot`` process killed) and
printed as ``>60 s``. Targets: every default render under 10 s; expanded no slower than torchviz.

Usage::

    python bench/render_bench.py [--timeout 60] [--models mlp,lstm_unrolled_200]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


REPEATS = 3


def child(model: str, mode: str, timeout: int) -> dict:
    """Build ``model``, then time its render in this process; SIGALRM stops it (and kills dot)."""
    import _models

    loss, m = _models.MODELS[model]()
    out = os.path.join(tempfile.mkdtemp(prefix="render-bench-"), "graph")
    _warm_up(mode, out + "-warm")
    signal.signal(signal.SIGALRM, _alarm)
    result = {"model": model, "mode": mode}
    signal.alarm(timeout)
    try:
        best = None
        for _ in range(REPEATS):      # quick renders: best of a few (the machine is shared and noisy)
            once = _once(mode, loss, m, out, result)
            best = once if best is None else min(best, once)
            if best > 2.0:
                break
        result.update(seconds=best, status="ok")
    except _Timeout:
        result.update(seconds=float(timeout), status="timeout")
    finally:
        signal.alarm(0)
    return result


def _warm_up(mode: str, out: str) -> None:
    """First-call costs (imports, caches, the first dot process) are paid outside the timing."""
    import torch
    import torchviz

    import gradscope

    lin = torch.nn.Linear(2, 1)
    loss = lin(torch.ones(1, 2)).sum()
    if mode == "torchviz":
        torchviz.make_dot(loss, params=dict(lin.named_parameters())).render(out, format="svg", quiet=True)
    else:
        gradscope.inspect(loss, model=lin).render(out + ".svg")


def _once(mode: str, loss, m, out: str, result: dict) -> float:
    import re
    import threading

    import torchviz

    import gradscope

    start = time.perf_counter()
    if mode == "torchviz":
        # torchviz walks recursively: give it room (deep graphs overflow the default limits)
        sys.setrecursionlimit(1_000_000)
        threading.stack_size(512 * 1024 * 1024)
        box = {}
        th = threading.Thread(target=lambda: box.setdefault(
            "dot", torchviz.make_dot(loss, params=dict(m.named_parameters()))))
        th.start()
        th.join()
        box["dot"].render(out, format="svg", quiet=True)
        seconds = time.perf_counter() - start
        result["nodes"] = len(re.findall(r"^\t\S+ \[label=", box["dot"].source, flags=re.M))
        return seconds
    report = gradscope.inspect(loss, model=m)
    kw = {"collapse": False} if mode == "expanded" else {}
    report.render(out + ".svg", **kw)
    seconds = time.perf_counter() - start
    result["graph_nodes"] = report.graph.number_of_nodes()
    result["nodes"] = len(re.findall(r"^\t+\S+ \[label=", report.to_dot(**kw).source, flags=re.M))
    return seconds


def measure(model: str, mode: str, timeout: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", model, mode, "--timeout", str(timeout)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout + 180)     # + model build; the child stops itself
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"model": model, "mode": mode, "status": "timeout", "seconds": float(timeout)}
    lines = [x for x in out.decode().splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
        return {"model": model, "mode": mode, "status": f"error: {tail[0][:60]}", "seconds": float("nan")}
    return json.loads(lines[-1])


def _cell(r: dict, timeout: int) -> str:
    if r["status"] == "timeout":
        return f">{timeout} s"
    if r["status"] != "ok":
        return r["status"]
    return f"{r['seconds']:.2f} s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=int, default=60)
    ap.add_argument("--models", default="")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"))
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.timeout)))
        return 0
    import _models

    names = [n for n in args.models.split(",") if n] or list(_models.MODELS)
    print(f"render to SVG, timeout {args.timeout} s per render (graphviz dot; this machine, same run)\n")
    head = ("| model | graph nodes | default: drawn nodes | default | expanded | torchviz | "
            "expanded / torchviz |")
    print(head)
    print("|---|---|---|---|---|---|---|")
    worst_default = 0.0
    for name in names:
        d = measure(name, "default", args.timeout)
        e = measure(name, "expanded", args.timeout)
        t = measure(name, "torchviz", args.timeout)
        if d["status"] == "ok":
            worst_default = max(worst_default, d["seconds"])
        else:
            worst_default = float("inf")
        if e["status"] == "ok" and t["status"] == "ok":
            ratio = f"x{e['seconds'] / t['seconds']:.2f}"
        elif e["status"] == "ok" and t["status"] == "timeout":
            ratio = "torchviz timed out"
        elif e["status"] == "timeout" and t["status"] == "timeout":
            ratio = "both timed out"
        else:
            ratio = "-"
        print(f"| {name} | {d.get('graph_nodes', '?')} | {d.get('nodes', '?')} | {_cell(d, args.timeout)} | "
              f"{_cell(e, args.timeout)} | {_cell(t, args.timeout)} | {ratio} |", flush=True)
    print(f"\nslowest default render: {worst_default:.2f} s (target < 10 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
