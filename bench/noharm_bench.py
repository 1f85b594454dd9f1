"""Memory budget of inspect() on a 200k-node graph, in bytes per node.

Run:  .venv/bin/python bench/noharm_bench.py [NODES]

Builds a chain of NODES ops (alternating sin / mul, 4-element tensors, so the activations themselves are
small and the per-node cost of the walk dominates), then measures with tracemalloc (Python heap) and the
process RSS (/proc/self/statm, which also sees C++ allocations):
  graph     what torch's own graph costs (RSS growth while building it), as the baseline;
  peak      tracemalloc peak during inspect() above the level before it;
  retained  what the Report keeps (tracemalloc, after inspect returns, report alive);
  rss       RSS growth across inspect(), report alive;
  left      tracemalloc once the report and the loss are dropped and the deep-graph release finished;
  after     RSS at that point (stays up: the allocator keeps freed pages; "left" is the leak check).
The budget we state (docs/verification.md, "No harm"): peak <= 3 KiB per node and retained <= 2.5 KiB per node
(Python heap), and nothing left once the report and the loss are gone. Exit status 1 when over budget
or leaking. Numbers vary by a few percent between runs.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import gradscope
from gradscope.walk.release import pending

PEAK_BUDGET = 3072
RETAINED_BUDGET = 2560


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _chain(n):
    x = torch.randn(4, requires_grad=True)
    y = x
    for _ in range(n // 2):
        y = torch.sin(y)
        y = y * 1.0001
    return x, y.sum()


def _settle():
    deadline = time.time() + 60
    while pending() and time.time() < deadline:
        time.sleep(0.05)
    gc.collect()


def measure_rss(n: int) -> dict:
    """RSS growth of building the graph, of inspect() + report, and after dropping both (no tracing)."""
    gc.collect()
    r0 = rss()
    x, loss = _chain(n)
    r1 = rss()
    t0 = time.perf_counter()
    report = gradscope.inspect(loss, params={"x": x})
    dt = time.perf_counter() - t0
    r2 = rss()
    nodes = report.graph.number_of_nodes()
    del report, loss
    _settle()
    return {"nodes": nodes, "seconds": dt, "graph": r1 - r0, "inspect_rss": r2 - r1, "after_rss": rss() - r0}


def measure_traced(n: int) -> dict:
    """tracemalloc: peak during inspect(), what the report retains, what is left once both are dropped."""
    x, loss = _chain(n)
    gc.collect()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    report = gradscope.inspect(loss, params={"x": x})
    cur, peak = tracemalloc.get_traced_memory()
    del report, loss
    _settle()
    left, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"peak": peak - base, "retained": cur - base, "left": left - base}


def main(n: int) -> int:
    a = measure_rss(n)
    b = measure_traced(n)
    nodes = a["nodes"]
    graph = max(a["graph"], 1)
    rows = [
        ("graph itself (torch, RSS)", a["graph"]),
        ("inspect + report (RSS)", a["inspect_rss"]),
        ("inspect peak (tracemalloc)", b["peak"]),
        ("report retained (tracemalloc)", b["retained"]),
        ("left after drop (tracemalloc)", b["left"]),
        ("RSS after drop, vs start", a["after_rss"]),
    ]
    print(f"{nodes} nodes; inspect {a['seconds']:.2f} s ({a['seconds'] / nodes * 1e6:.1f} us/node, "
          "untraced run)")
    print(f"{'measure':32s} {'MiB':>8s} {'bytes/node':>11s} {'x graph':>8s}")
    for label, v in rows:
        print(f"{label:32s} {v / 2**20:8.1f} {v / nodes:11.0f} {v / graph:8.2f}")
    over = b["peak"] / nodes > PEAK_BUDGET or b["retained"] / nodes > RETAINED_BUDGET
    leak = b["left"] / nodes > 16
    print(f"budget: peak <= {PEAK_BUDGET} B/node, retained <= {RETAINED_BUDGET} B/node: "
          f"{'OVER' if over else 'within'}; left after drop: {'LEAK' if leak else 'none'} "
          "(RSS after drop stays up: freed memory is kept by the allocator, not by gradscope)")
    return 1 if over or leak else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200_000))
