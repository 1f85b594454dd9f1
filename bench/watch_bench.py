"""What ``gradscope.watch`` costs in a training loop, against no hooks and anomaly mode, in the same run.

For each model, one training step is forward + backward + ``AdamW.step()``. Modes, interleaved within
every repeat so drift on a shared machine hits them alike:
  base     no hooks;
  watch    ``gradscope.watch(model, optimizer=opt)``: everything on (missing and non-finite gradients,
           the cross-step graph checks, gradient-flow history, update/weight ratios every 100 steps, NaN
           origin armed only after a non-finite step);
  naive    a per-parameter post-accumulate hook running ``torch.isnan(p.grad).any()`` / ``isinf`` (one
           check, and on a GPU one sync, per tensor): what ``watch`` batches instead;
  anomaly  ``torch.autograd.set_detect_anomaly(True)``.
Each repeat times ``--steps`` consecutive steps per mode (their total, so a cost paid on one step in many
counts); each ratio is the median over repeats of (mode / base) from the same repeat. Target: watch at
most 1.05x on the two models (exit status 1 when missed). The tiny MLP line shows watch's fixed cost per
step (hooks, callbacks, the three-call norm pass), which dominates sub-millisecond steps; it is reported,
not gated.

Steps run on one thread and are timed with ``time.process_time`` (CPU time of this process) by default:
on a shared machine wall-clock time mostly measures the neighbours (``--clock wall`` to see it).

Run: ``.venv/bin/python bench/watch_bench.py [--repeats N] [--steps N]``.
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

from _models import gpt2_small_like, resnet18_like

import gradscope

MODES = ("base", "watch", "naive", "anomaly")


def tiny_case():
    """A tiny MLP (3 Linear layers of 32 units, batch 8): the per-step fixed cost shows here."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 1))
    x = torch.randn(8, 32)
    return "tiny MLP (3x32, batch 8)", model, lambda: model(x).pow(2).mean()


def gpt_case():
    """GPT-2-small's layout scaled to fit a CPU step: 4 blocks, d=256, 4 heads, vocab 4096, 2x64 tokens."""
    vocab, ctx, batch = 4096, 64, 2
    _, model = gpt2_small_like(n_layer=4, d=256, heads=4, vocab=vocab, ctx=ctx, batch=1, device="cpu")
    idx = torch.randint(0, vocab, (batch, ctx))

    def loss_fn():
        logits = model(idx)
        return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), idx[:, 1:].reshape(-1))
    return "gpt2_small_like (4x256, vocab 4096)", model, loss_fn


def resnet_case():
    """ResNet-18's layout (width 64) on a batch of 2 images of 32x32."""
    _, model = resnet18_like(batch=2, size=32, width=64, device="cpu")
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    return "resnet18_like (2x3x32x32)", model, lambda: F.cross_entropy(model(x), y)


class Naive:
    """The per-tensor alternative: check each gradient for NaN/Inf as it is accumulated."""

    def __init__(self, model):
        def hook(p):
            if torch.isnan(p.grad).any() or torch.isinf(p.grad).any():
                raise RuntimeError("non-finite gradient")
        self.handles = [p.register_post_accumulate_grad_hook(hook) for p in model.parameters()]

    def remove(self):
        for h in self.handles:
            h.remove()


def run_mode(mode, model, loss_fn, opt, steps, clock=time.process_time) -> float:
    """Total time of ``steps`` consecutive steps in ``mode``."""
    guard = (gradscope.watch(model, optimizer=opt) if mode == "watch" else Naive(model) if mode == "naive"
             else None)
    try:
        with torch.autograd.set_detect_anomaly(mode == "anomaly", check_nan=True):
            t0 = clock()
            for _ in range(steps):
                opt.zero_grad()
                loss_fn().backward()
                opt.step()
            return clock() - t0
    finally:
        if guard is not None:
            guard.remove()


def bench(case, repeats, steps, clock):
    name, model, loss_fn = case()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for mode in MODES:                       # warm-up: allocator, lazy imports, first optimizer state
        run_mode(mode, model, loss_fn, opt, 2)
    totals = {m: [] for m in MODES}
    for r in range(repeats):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for mode in order:
            totals[mode].append(run_mode(mode, model, loss_fn, opt, steps, clock) / steps)
    ratios = {m: statistics.median(a / b for a, b in zip(totals[m], totals["base"])) for m in MODES}
    extra = statistics.median(a - b for a, b in zip(totals["watch"], totals["base"]))
    return name, n_params, statistics.median(totals["base"]), ratios, extra


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--clock", choices=("process", "wall"), default="process",
                    help="process: CPU time of this process (default); wall: perf_counter")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--models", default="gpt,resnet,tiny", help="comma-separated subset of gpt,resnet,tiny")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    clock = time.process_time if args.clock == "process" else time.perf_counter
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.clock} time, "
          f"{args.repeats} repeats x {args.steps} steps per mode (forward + backward + AdamW step)\n")
    header = (f"{'model':<38} {'params':>7} {'base/step':>10} {'watch':>7} {'(+/step)':>9} {'naive':>7} "
              f"{'anomaly':>8}")
    print(header)
    print("-" * len(header))
    worst = 0.0
    cases = {"gpt": gpt_case, "resnet": resnet_case, "tiny": tiny_case}
    for case in [cases[m] for m in args.models.split(",")]:
        name, n, base, r, extra = bench(case, args.repeats if case is not tiny_case else args.repeats * 2,
                                        args.steps if case is not tiny_case else args.steps * 10, clock)
        if case is not tiny_case:
            worst = max(worst, r["watch"])
        print(f"{name:<38} {n / 1e6:>6.2f}M {base * 1e3:>8.2f}ms {r['watch']:>6.3f}x {extra * 1e6:>7.0f}us "
              f"{r['naive']:>6.3f}x {r['anomaly']:>7.2f}x", flush=True)
    ok = worst <= 1.05
    print(f"\nwatch (everything on), worst model: {worst:.3f}x (target <= 1.05x): {'OK' if ok else 'OVER TARGET'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
