"""``report.backward_memory()`` against ``torch.cuda.memory`` statistics, when a CUDA device exists.

Per model of tests/_memmodels.py on ``cuda:0``: the predicted backward peak and the level after backward
against ``torch.cuda.max_memory_allocated()`` / ``memory_allocated()`` around ``loss.backward()`` (CUDA's
caching allocator rounds each block up to 512 bytes, so the prediction is rounded the same way per saved
storage and gradient before comparing: see ``_rounded``). Kernel workspace is calibrated on CPU, so cuDNN
workspace is not in the prediction; the error column shows how much that matters. Without CUDA the script
says so and exits 0.

    python bench/memory_gpu.py [model ...]
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gradscope
from gradscope._format import human_bytes
from tests._memmodels import MODELS

warnings.filterwarnings("ignore")
TARGET = 0.10   # MemTracker's own GPU test tolerance is +-10%


def _rounded(n: int) -> int:
    return (n + 511) // 512 * 512 if n else 0


def run(name: str) -> tuple:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model, inputs, loss_fn = MODELS[name]()
    from gradscope.memory.replay.backward import Overrides, replay

    loss = loss_fn(model, *inputs)
    report = gradscope.inspect(loss, model=model)
    bm = replay(report, Overrides(scale=lambda shape, dtype, nbytes: _rounded(nbytes)))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    end = torch.cuda.memory_allocated() - start
    return name, bm.peak, peak, bm.end, end


def main(argv: list[str]) -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to compare (run this on a GPU machine)")
        return 0
    rows, missed = [], []
    for name in argv or list(MODELS):
        try:
            r = run(name)
        except Exception as exc:  # noqa: BLE001 - a model that does not run on this GPU is a result
            print(f"{name}: {type(exc).__name__}: {exc}".splitlines()[0])
            continue
        err = (r[1] - r[2]) / r[2] if r[2] else 0.0
        if abs(err) > TARGET:
            missed.append(name)
        rows.append((name, human_bytes(r[1]), human_bytes(r[2]), f"{err * 100:+.1f}%", human_bytes(r[3]),
                     human_bytes(r[4])))
    head = ("model", "predicted peak", "cuda peak", "err", "predicted end", "cuda end")
    widths = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
    print(f"backward_memory() vs torch.cuda.memory on {torch.cuda.get_device_name(0)}")
    for line in [head] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)))
    if missed:
        print(f"more than {TARGET:.0%} off on: {', '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
