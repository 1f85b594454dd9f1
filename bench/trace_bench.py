"""Forward time under ``gradscope.trace()`` as a ratio to a plain forward, measured in the same run.

Each repeat times the plain forward, the traced forward (entering and leaving ``trace()`` included)
and the floor back to back, alternating the order; the table shows medians and their ratios to the
plain forward. ``floor`` is the same forward under no-op global module hooks and a TorchFunctionMode
that only forwards each call: the cost of the mechanism itself, which any tracer built on them pays.
Target: at most 1.3x on the GPT-2-small-like and ResNet-18-like models (CPU, real data); the exit status
is 1 when a target is missed. The tiny GPT
and the MLP are the worst case: so little compute per op that the fixed cost of the hooks and the mode
(a few microseconds per module call and per torch function call) shows on its own. The reentrant row
is the tiny GPT with each block under ``checkpoint(..., use_reentrant=True)``: inside such a region the
trace also records every call for ``backward_memory()`` (tracing/regions.py), a stack walk and the
call's arguments as plain data per op.

Vision models (``_vision.py``: ResNet-50-D, Swin-T, EfficientNet-B0, RegNetY, ConvNeXt-T from Hugging Face
transformers configs with random weights, an SK-ResNet-18 by hand), the families where a traced forward cost
most in the model sweep: each is timed the same way, and the table adds the p90 of the per-repeat ratios
(traced / plain of the same repeat). Target: the p90 over the vision models of their median ratios is at
most 1.3x (exit 1 above). ``--vision-only`` runs just them; ``--no-vision`` skips them.

Run: ``.venv/bin/python bench/trace_bench.py [--repeat N] [--threads T] [--vision-only | --no-vision]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.nn.modules import module as nn_module
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _models import gpt2_small_like, mlp, resnet18_like
from _vision import VISION

import gradscope


def _gpt(**kwargs):
    _, model = gpt2_small_like(device="cpu", **kwargs)
    idx = torch.zeros(1, model.wpe.weight.shape[0], dtype=torch.long)
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


class _Reentrant(torch.nn.Module):
    """A block run as ``checkpoint(block, x, use_reentrant=True)``: its ops are recorded for backward_memory()."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=True)


def _gpt_reentrant():
    model, forward = _gpt(n_layer=2, d=64, heads=4, vocab=512, ctx=16)
    model.blocks = torch.nn.Sequential(*(_Reentrant(b) for b in model.blocks))
    return model, forward


CASES = {
    "gpt2_small_like": _gpt,
    "resnet18_like": _resnet,
    "gpt tiny (2 layers, d=64, ctx 16)": lambda: _gpt(n_layer=2, d=64, heads=4, vocab=512, ctx=16),
    "mlp (4 x Linear(256), batch 32)": _mlp,
    "gpt tiny, reentrant checkpoint/block": _gpt_reentrant,
}


#: The stated targets: model -> the highest trace()/forward ratio we accept. The small models have none.
TARGETS = {"gpt2_small_like": 1.3, "resnet18_like": 1.3}
#: The highest p90, over the vision models, of their median trace()/forward ratios.
VISION_P90_TARGET = 1.3


class _EmptyMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _floor(forward):
    """What any hook + TorchFunctionMode tracer pays: no-op global hooks and a mode that only forwards."""
    pre = nn_module.register_module_forward_pre_hook(lambda m, a: None)
    post = nn_module.register_module_forward_hook(lambda m, a, o: None, always_call=True)
    try:
        with _EmptyMode():
            return forward()
    finally:
        pre.remove()
        post.remove()


#: The clock of a sample: ``time.process_time`` (CPU seconds of this process: on a shared machine it does
#: not count the time other processes hold the cores) or ``time.perf_counter`` (wall); ``--clock``.
CLOCK = {"cpu": time.process_time, "wall": time.perf_counter}
_clock = time.process_time


def _time(fn, n: int) -> float:
    t0 = _clock()
    for _ in range(n):
        fn()
    return (_clock() - t0) / n


def measure(model, forward, repeat: int) -> tuple[float, float, float, int, float]:
    """Medians of the plain forward, the traced one and the floor, the traced forward's calls, and the p90
    of the per-repeat ratios traced / plain."""
    def traced():
        with gradscope.trace(model):
            return forward()

    def floor():
        return _floor(forward)

    forward(), traced(), floor()              # warm up caches on every path
    t0 = time.perf_counter()
    forward()
    n = max(1, min(50, int(0.05 / max(time.perf_counter() - t0, 1e-6))))   # ~50 ms per sample (wall)
    plain, trace, bare = [], [], []
    for i in range(repeat):
        runs = [(plain, forward), (trace, traced), (bare, floor)]
        for out, fn in (runs if i % 2 == 0 else reversed(runs)):
            out.append(_time(fn, n))
    with gradscope.trace(model) as tr:
        forward()
    paired = [t / p for t, p in zip(trace, plain)]
    return (statistics.median(plain), statistics.median(trace), statistics.median(bare), len(tr.calls),
            _p90(paired))


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=9, help="interleaved repeats per model (default 9)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: less noise)")
    ap.add_argument("--clock", choices=sorted(CLOCK), default="cpu",
                    help="cpu: CPU seconds of this process (default; robust to other load), wall: elapsed")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--vision-only", action="store_true", help="only the vision models")
    group.add_argument("--no-vision", action="store_true", help="skip the vision models")
    args = ap.parse_args(argv)
    global _clock
    _clock = CLOCK[args.clock]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), median of {args.repeat} "
          f"interleaved repeats, {args.clock} clock")
    print(f"{'model':<36} {'calls':>6} {'forward':>10} {'trace()':>10} {'ratio':>7} {'p90':>6} {'floor':>7}")
    missed = []
    cases = {} if args.vision_only else dict(CASES)
    if not args.no_vision:
        cases.update(VISION)
    vision = []
    for name, build in cases.items():
        model, forward = build()
        model.train()
        plain, traced, bare, calls, p90 = measure(model, forward, args.repeat)
        target = TARGETS.get(name)
        verdict = "" if target is None else (f"  <= {target}x ok" if traced / plain <= target else
                                             f"  MISSED (target {target}x)")
        if target is not None and traced / plain > target:
            missed.append(name)
        if name in VISION:
            vision.append(traced / plain)
        print(f"{name:<36} {calls:>6} {plain * 1e3:>8.2f}ms {traced * 1e3:>8.2f}ms {traced / plain:>6.2f}x "
              f"{p90:>5.2f}x {bare / plain:>6.2f}x{verdict}", flush=True)
        del model, forward
    if vision:
        p90 = _p90(vision)
        ok = p90 <= VISION_P90_TARGET
        print(f"vision models ({len(vision)}): median ratio {statistics.median(vision):.2f}x, p90 {p90:.2f}x "
              f"({'<=' if ok else 'MISSED, target'} {VISION_P90_TARGET}x)")
        if not ok:
            missed.append("the vision models' p90")
    if missed:
        print(f"target missed on {', '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
