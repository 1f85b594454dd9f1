"""The fixed costs of ``inspect()``, ``trace()`` and ``watch()``: what a call costs whatever the model does.

On sub-millisecond models these fixed costs, not the per-node or per-op work, decide the ratios the other
benches print. Each line is the minimum over interleaved rounds of thread CPU time (the machine is shared:
the minimum is the least disturbed sample), next to the baseline it is a difference from, measured in the
same run:

inspect()  per call, on the bench models: the model's parameter names and buffers (``names_and_buffers``:
           from the per-model structure cache, NOTE [model structure cache], next to torch's own
           ``named_parameters()`` + ``buffers()``), the checks, the report; and the whole call next to the
           bare walk of ``inspect_bench.py``.
trace()    entering and leaving an empty ``with trace(model):``; per module call and per torch function
           call inside it (200 of each), next to the floor (no-op global module hooks and a forwarding
           ``TorchFunctionMode``, what any tracer built on them pays).
watch()    per training step of the tiny MLP of ``watch_bench.py``: the plain step, the floor (two no-op
           hooks per parameter, no-op forward hooks on the root, one engine callback per backward), and
           ``watch()`` with everything on and with parts switched off (the difference is that part's cost).

Reports only (no target; exit status 0). Run: ``python bench/fixed_bench.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _models import MODELS
from inspect_bench import bare_walk
from trace_bench import _EmptyMode, _floor
from watch_bench import tiny_case

import gradscope
from gradscope import _torch
from gradscope.checks import run_checks
from gradscope.walk.build import build, flatten_roots
from gradscope.walk.compact import CompactGraph
from gradscope.walk.named import names_and_buffers
from gradscope.walk.records import node_id


def _min_time(fns: dict, rounds: int, number: int) -> dict:
    """Per-call thread time of each function: the minimum over ``rounds`` interleaved samples."""
    best = {k: float("inf") for k in fns}
    for r in range(rounds):
        for k in list(fns) if r % 2 == 0 else list(fns)[::-1]:
            fn = fns[k]
            t0 = time.thread_time()
            for _ in range(number):
                fn()
            best[k] = min(best[k], (time.thread_time() - t0) / number)
    return best


def _us(t: float) -> str:
    return f"{t * 1e6:8.1f} us"


def inspect_costs(rounds: int) -> None:
    print("inspect(): per call")
    print(f"  {'model':18s} {'params':>6s} {'modules':>7s} {'names+buffers':>13s} {'torch named_':>13s} "
          f"{'checks':>9s} {'bare walk':>10s} {'inspect':>10s}")
    for name in ("mlp", "resnet18_like", "gpt2_small_like"):
        torch.manual_seed(0)
        loss, model = MODELS[name]()
        roots = flatten_roots(loss)
        names, buffers = names_and_buffers(model)
        records = build(roots, names, buffers)
        special = [node_id(i) for i in records.special]
        fns = {
            "names": lambda m=model: names_and_buffers(m),
            "torch": lambda m=model: (dict(m.named_parameters()), list(m.buffers())),
            "checks": lambda r=records, s=special: run_checks(CompactGraph(r), s),
            "bare": lambda x=loss: bare_walk(x),
            "inspect": lambda x=loss, m=model: gradscope.inspect(x, model=m),
        }
        t = _min_time(fns, rounds, 20 if name == "gpt2_small_like" else 100)
        n_mod = sum(1 for _ in model.modules())
        print(f"  {name:18s} {len(names):6d} {n_mod:7d} {_us(t['names']):>13s} {_us(t['torch']):>13s} "
              f"{_us(t['checks'])} {_us(t['bare'])} {_us(t['inspect'])}  (x{t['inspect'] / t['bare']:.1f} bare)")


class _Id(torch.nn.Module):
    def forward(self, x):
        return x


def trace_costs(rounds: int) -> None:
    mods = torch.nn.Sequential(*[_Id() for _ in range(200)])
    w = torch.nn.Parameter(torch.ones(4))

    def ops():
        y = w
        for _ in range(200):
            y = y + 1
        return y

    def calls():
        return mods(w)

    def empty():
        with gradscope.trace(mods):
            pass

    def traced(fn):
        def run():
            with gradscope.trace(mods):
                fn()
        return run

    def mode_only():
        with _EmptyMode():
            pass

    def hooks_only():
        pre = _torch.register_module_forward_pre_hook(lambda m, a: None)
        post = _torch.register_module_forward_hook(lambda m, a, o: None, always_call=True)
        pre.remove()
        post.remove()

    t = _min_time({"empty": empty, "mode": mode_only, "hooks": hooks_only}, rounds, 500)
    enter_exit = t["empty"]
    print("\ntrace(): enter + exit of an empty `with trace(model):`"
          f" {_us(t['empty'])} (of which registering and removing the two global module hooks "
          f"{_us(t['hooks']).strip()}, pushing and popping a TorchFunctionMode {_us(t['mode']).strip()})")
    for what, fn in (("module call", calls), ("torch function call", ops)):
        t = _min_time({"plain": fn, "trace": traced(fn), "floor": lambda fn=fn: _floor(fn)}, rounds, 20)
        print(f"  per {what:20s} trace() +{(t['trace'] - t['plain'] - enter_exit) / 200 * 1e6:.2f} us, "
              f"floor +{(t['floor'] - t['plain']) / 200 * 1e6:.2f} us (plain {t['plain'] / 200 * 1e6:.2f} us)")


class _Floor:
    """watch()'s mechanism with nothing in it: two no-op hooks per parameter, no-op root forward hooks, one
    engine callback per backward."""

    def __init__(self, model):
        self.queued: set = set()

        def arrived(_grad):
            return None

        def accumulated(_param):
            if not self.queued:
                self.queued.add(1)
                _torch.queue_engine_callback(self.queued.clear)

        self.handles = [h for p in model.parameters()
                        for h in (p.register_hook(arrived), p.register_post_accumulate_grad_hook(accumulated))]
        self.handles += [model.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True),
                         model.register_forward_hook(lambda m, a, o: None)]

    def remove(self):
        for h in self.handles:
            h.remove()


def watch_costs(rounds: int, steps: int = 20) -> None:
    name, model, loss_fn = tiny_case()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def sample(make) -> float:
        """Thread time per step of ``steps`` steps under the guard ``make()`` (installed before timing)."""
        guard = make()
        try:
            t0 = time.thread_time()
            for _ in range(steps):
                opt.zero_grad()
                loss_fn(model).backward()
                opt.step()
            return (time.thread_time() - t0) / steps
        finally:
            if guard is not None:
                guard.remove()

    variants = {
        "plain step": lambda: None,
        "floor (no-op hooks)": lambda: _Floor(model),
        "watch(model, optimizer=opt): all on": lambda: gradscope.watch(model, optimizer=opt),
        "  graphs=False": lambda: gradscope.watch(model, optimizer=opt, graphs=False),
        "  history=0": lambda: gradscope.watch(model, optimizer=opt, history=0),
        "  check_nonfinite=False, history=0": lambda: gradscope.watch(
            model, optimizer=opt, check_nonfinite=False, history=0
        ),
        "  no optimizer (no update ratios)": lambda: gradscope.watch(model),
    }
    for make in variants.values():
        sample(make)
    best = {k: float("inf") for k in variants}
    for r in range(rounds * 2):
        for k in list(variants) if r % 2 == 0 else list(variants)[::-1]:
            best[k] = min(best[k], sample(variants[k]))
    base = best["plain step"]
    print(f"\nwatch(): per training step of the {name} (forward + backward + AdamW), {steps} steps per sample")
    for k, v in best.items():
        sign = "+" if v >= base else "-"
        print(f"  {k:40s} {v * 1e6:8.1f} us/step  {sign}{abs(v - base) * 1e6:6.1f} us (x{v / base:.3f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds per measurement (default 9)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, thread CPU time, minimum of {args.rounds} interleaved rounds\n")
    inspect_costs(args.rounds)
    trace_costs(args.rounds)
    watch_costs(args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
