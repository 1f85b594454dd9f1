"""Default render time and drawing size per gallery model, next to torchviz + dot and torchview.

Every gallery model (tests/_render_models.py: GPT-2, a 12-layer GPT-2-small config, BERT, T5, ViT,
ResNet-18, an LSTM unrolled 200 steps, a 96-layer transformer, a 10k chain) runs its forward pass once
in its own process; then, on that same graph and machine:

* ``gradscope``  ``gradscope.inspect(loss, model=m).render("x.svg")``: the default drawing, laid out
* ``torchviz``   ``torchviz.make_dot(loss, params=...)`` then ``dot -Tsvg`` on its source
* ``torchview``  ``torchview.draw_graph(model, ...)`` (its defaults; it runs the forward again, which
  is part of its cost) then ``dot -Tsvg``

Each cell is the wall time and the drawing's size in pt (from the SVG). A layout that passes
``--timeout`` seconds is stopped and shown as ``>T s``; a tool that is not installed shows
``not installed`` (pip install torchviz torchview, the ``bench`` extra).

Targets (exit 1 when missed): every gradscope default render under 10 s, and its drawing legible by
the rules in gradscope.views.fit (longer side <= 3,000 pt, aspect <= 4:1, finding text >= 10 px at a
1,600 px wide window).

Usage::

    python bench/render_bench.py [--timeout 20] [--models gpt2,resnet18]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

TARGET_S = 10.0
_SIZE = re.compile(rb'<svg width="([\d.]+)pt" height="([\d.]+)pt"')


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _size(svg: bytes):
    m = _SIZE.search(svg)
    return [float(m.group(1)), float(m.group(2))] if m else None


def _dot(source: str, timeout: float) -> bytes:
    """``dot -Tsvg`` with a hard timeout (the process is killed when it passes)."""
    try:
        return subprocess.run(["dot", "-Tsvg"], input=source.encode(), capture_output=True, check=True,
                              timeout=max(timeout, 0.1)).stdout
    except subprocess.TimeoutExpired:
        raise _Timeout() from None


def _timed(fn, timeout: int) -> dict:
    """Run ``fn(deadline)`` under SIGALRM; ``{"status", "seconds", "size"}``."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    t0 = time.perf_counter()
    try:
        size = fn(t0 + timeout)
        return {"status": "ok", "seconds": time.perf_counter() - t0, "size": size}
    except _Timeout:
        return {"status": "timeout", "seconds": float(timeout)}
    except ImportError:
        return {"status": "not installed"}
    except Exception as exc:                                     # a peer tool failing is a result too
        return {"status": f"error: {type(exc).__name__}: {str(exc)[:60]}"}
    finally:
        signal.alarm(0)


def child(name: str, timeout: int) -> dict:
    import torch

    import gradscope
    from tests._render_models import GALLERY

    loss, model = GALLERY[name](False)
    out = tempfile.mkdtemp(prefix="render-bench-")
    _warm_up(out)
    result = {"model": name}

    def ours(deadline):
        report = gradscope.inspect(loss, model=model)
        path = report.render(os.path.join(out, "g.svg"))
        result["nodes"] = report.graph.number_of_nodes()
        with open(path, "rb") as f:
            svg = f.read()
        result["boxes"] = svg.count(b'class="node')
        return _size(svg)

    def viz(deadline):
        import torchviz

        src = torchviz.make_dot(loss, params=dict(model.named_parameters())).source
        return _size(_dot(src, deadline - time.perf_counter()))

    def view(deadline):
        import torchview

        class Again(torch.nn.Module):          # torchview runs the forward itself, on this model
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, x):
                return GALLERY[name](False, model=self.model)[0]

        src = torchview.draw_graph(Again(), input_data=[torch.zeros(1)]).visual_graph.source
        return _size(_dot(src, deadline - time.perf_counter()))

    sys.setrecursionlimit(100_000)             # torchviz walks recursively
    result["gradscope"] = _timed(ours, timeout)
    result["torchviz"] = _timed(viz, timeout)
    result["torchview"] = _timed(view, timeout)
    return result


def _warm_up(out: str) -> None:
    """First-call costs (imports, the first dot process) are paid outside the timing."""
    import torch

    import gradscope

    lin = torch.nn.Linear(2, 1)
    gradscope.inspect(lin(torch.ones(1, 2)).sum(), model=lin).render(os.path.join(out, "warm.svg"))


def measure(name: str, timeout: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--timeout", str(timeout)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env=env)
    try:
        out, err = proc.communicate(timeout=3 * timeout + 180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"model": name, "error": "the whole run timed out"}
    lines = [x for x in out.decode().splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
        return {"model": name, "error": tail[0][:80]}
    return json.loads(lines[-1])


def _cell(r: dict, timeout: int) -> str:
    if r["status"] == "timeout":
        return f">{timeout} s"
    if r["status"] != "ok":
        return r["status"]
    size = f"{r['size'][0]:,.0f} x {r['size'][1]:,.0f} pt" if r.get("size") else "?"
    return f"{r['seconds']:.2f} s, {size}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=int, default=20, help="seconds per render (default 20)")
    ap.add_argument("--models", default="", help="comma-separated gallery names (default: all)")
    ap.add_argument("--child", metavar="MODEL")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.timeout)))
        return 0
    from gradscope.views.fit import legible
    from tests._render_models import GALLERY

    names = [n for n in args.models.split(",") if n] or list(GALLERY)
    print(f"default render to SVG (time, drawing size), timeout {args.timeout} s per render; this machine, "
          f"same run\n")
    print("| model | graph nodes | gradscope default | boxes drawn | legible | torchviz + dot | torchview |")
    print("|---|---|---|---|---|---|---|")
    missed = []
    for name in names:
        r = measure(name, args.timeout)
        if "error" in r:
            print(f"| {name} | ? | {r['error']} | | | | |", flush=True)
            missed.append(f"{name}: {r['error']}")
            continue
        ours = r["gradscope"]
        why = legible(*ours["size"]) if ours["status"] == "ok" and ours.get("size") else "no drawing"
        if ours["status"] != "ok" or ours["seconds"] > TARGET_S:
            missed.append(f"{name}: default render {_cell(ours, args.timeout)} (target < {TARGET_S:g} s)")
        if why:
            missed.append(f"{name}: {why}")
        print(f"| {name} | {r.get('nodes', '?')} | {_cell(ours, args.timeout)} | {r.get('boxes', '?')} | "
              f"{'yes' if not why else 'NO'} | {_cell(r['torchviz'], args.timeout)} | "
              f"{_cell(r['torchview'], args.timeout)} |", flush=True)
    print()
    if missed:
        print("MISSED:\n  " + "\n  ".join(missed))
        return 1
    print(f"all default renders under {TARGET_S:g} s and legible (longer side <= 3,000 pt, aspect <= 4:1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
