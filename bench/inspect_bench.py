"""inspect() speed against the physical limit and against torchviz, in the same run.

For each bench model: node count, saved bytes, and the time of ``gradscope.inspect`` as a ratio to
  (a) a bare iterative walk that reads ``next_functions`` and every saved tensor's metadata with the
      attribute names cached per node type (what any inspector must at least do), and
  (b) ``torchviz.make_dot(..., show_attrs=True, show_saved=True)`` (builds the DOT source; no layout).
Targets: inspect within 3x of (a) and at least 5x faster than (b) on every model.

Run: ``.venv/bin/python bench/inspect_bench.py [--repeat N]`` (``make bench`` installs torchviz).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gradscope  # noqa: E402
from gradscope._format import human_bytes  # noqa: E402
from _models import MODELS, chain  # noqa: E402

try:
    import torchviz
except ImportError:  # pragma: no cover - bench-only dependency
    torchviz = None

_CACHE: dict = {}


def bare_walk(loss) -> int:
    """The floor: visit every node once, read every saved tensor's shape/dtype/device/storage size."""
    root = loss.grad_fn
    seen = {root}
    stack = [root]
    while stack:
        node = stack.pop()
        cls = type(node)
        names = _CACHE.get(cls)
        if names is None:
            names = _CACHE[cls] = [a for a in dir(cls) if a.startswith("_raw_saved_")]
        for a in names:
            raw = getattr(node, a)
            for r in (raw if isinstance(raw, (list, tuple)) else (raw,)):
                t = r.data
                if isinstance(t, torch.Tensor):
                    (t.shape, t.dtype, t.device, t.untyped_storage().nbytes())
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return len(seen)


def _timed(fn, repeat: int) -> float:
    # CPU time of this thread, not wall time: the machines are shared, and every timed function here is
    # single-threaded Python, so thread CPU time is what it costs and is robust to neighbours' load.
    times = []
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def _big_stack(fn):
    """Run ``fn`` on a thread with a 512 MiB stack (torchviz recurses once per graph level)."""
    out = {}

    def run():
        try:
            out["v"] = fn()
        except BaseException as exc:  # noqa: BLE001
            out["e"] = exc

    old = threading.stack_size()
    threading.stack_size(512 * 1024 * 1024)
    try:
        t = threading.Thread(target=run)
        t.start()
        t.join()
    finally:
        threading.stack_size(old)
    if "e" in out:
        raise out["e"]
    return out["v"]


def torchviz_time(loss, model, repeat: int) -> float | None:
    if torchviz is None:
        return None
    params = dict(model.named_parameters())
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(1_000_000)
    try:
        return _big_stack(lambda: _timed(lambda: torchviz.make_dot(loss, params=params, show_attrs=True,
                                                                   show_saved=True), repeat))
    finally:
        sys.setrecursionlimit(old)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    models = dict(MODELS)
    models["chain_50k"] = lambda: chain(50_000)
    rows = []
    for name, build in models.items():
        torch.manual_seed(0)
        loss, model = build()
        report = gradscope.inspect(loss, model=model)  # warm type caches; holds deep graphs safely
        n = report.graph.number_of_nodes()
        repeat = args.repeat if n < 20_000 else max(1, args.repeat // 2)
        t_bare = _timed(lambda: bare_walk(loss), repeat)
        t_gs = _timed(lambda: gradscope.inspect(loss, model=model), repeat)
        t_viz = torchviz_time(loss, model, max(1, repeat // 2 if n > 5000 else repeat))
        rows.append((name, n, report.saved_bytes, t_gs, t_bare, t_viz))
        print(f"  measured {name}", file=sys.stderr, flush=True)
        del loss, model, report
    print()
    print(f"{'model':<22}{'nodes':>8}{'saved':>12}{'inspect':>11}{'µs/node':>9}{'vs bare':>9}"
          f"{'torchviz':>11}{'speedup':>9}")
    ok = True
    for name, n, saved, t_gs, t_bare, t_viz in rows:
        ratio = t_gs / t_bare
        speed = (t_viz / t_gs) if t_viz else float("nan")
        ok &= ratio <= 3 and (t_viz is None or speed >= 5)
        viz = f"{t_viz * 1e3:9.1f}ms" if t_viz else "      n/a"
        print(f"{name:<22}{n:>8}{human_bytes(saved):>12}"
              f"{t_gs * 1e3:9.1f}ms{t_gs / n * 1e6:9.1f}{ratio:8.2f}x{viz:>11}{speed:8.1f}x")
    print()
    print("targets: inspect <= 3x bare walk, >= 5x faster than torchviz:", "MET" if ok else "NOT MET")


if __name__ == "__main__":
    main()
