"""Forward time under ``gradscope.trace()`` as a ratio to a plain forward, measured in the same run.

Each repeat times the plain forward and the traced forward (entering and leaving ``trace()``
included) back to back, alternating which goes first; the table shows the median of each and their
ratio. Target: at most 1.3x on the GPT-2-small-like and ResNet-18-like models (CPU, real data). The
``meta`` and MLP rows are the worst case: almost no compute, so they show the per-op and per-module
bookkeeping cost on its own.

Run: ``.venv/bin/python bench/trace_bench.py [--repeat N] [--threads T]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gradscope  # noqa: E402
from _models import gpt2_small_like, mlp, resnet18_like  # noqa: E402


def _gpt(device: str):
    _, model = gpt2_small_like(device=device)
    idx = torch.zeros(1, 64, dtype=torch.long, device=device)
    vocab = model.wte.weight.shape[0]
    return model, lambda: F.cross_entropy(model(idx).view(-1, vocab), idx.view(-1))


def _resnet():
    _, model = resnet18_like()
    x = torch.randn(2, 3, 32, 32)
    y = torch.zeros(2, dtype=torch.long)
    return model, lambda: F.cross_entropy(model(x), y)


def _mlp():
    _, model = mlp()
    x = torch.randn(32, 256)
    return model, lambda: model(x).pow(2).mean()


CASES = {
    "gpt2_small_like (cpu)": lambda: _gpt("cpu"),
    "resnet18_like (cpu)": _resnet,
    "gpt2_small_like (meta, no compute)": lambda: _gpt("meta"),
    "mlp (cpu, tiny)": _mlp,
}


def _time(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def measure(model, forward, repeat: int) -> tuple[float, float, int]:
    def traced():
        with gradscope.trace(model):
            return forward()

    forward(), traced()                       # warm up caches on both paths
    t0 = time.perf_counter()
    forward()
    n = max(1, min(50, int(0.05 / max(time.perf_counter() - t0, 1e-6))))   # ~50 ms per sample
    plain, trace = [], []
    for i in range(repeat):
        pair = [(plain, forward), (trace, traced)]
        for out, fn in (pair if i % 2 == 0 else reversed(pair)):
            out.append(_time(fn, n))
    with gradscope.trace(model) as tr:
        forward()
    return statistics.median(plain), statistics.median(trace), len(tr._calls)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=9, help="interleaved repeats per model (default 9)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: less noise)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), median of {args.repeat} "
          "interleaved repeats")
    print(f"{'model':<36} {'calls':>6} {'forward':>10} {'trace()':>10} {'ratio':>7}")
    for name, build in CASES.items():
        model, forward = build()
        model.train()
        plain, traced, calls = measure(model, forward, args.repeat)
        print(f"{name:<36} {calls:>6} {plain * 1e3:>8.2f}ms {traced * 1e3:>8.2f}ms {traced / plain:>6.2f}x")
        del model, forward
    return 0


if __name__ == "__main__":
    sys.exit(main())
