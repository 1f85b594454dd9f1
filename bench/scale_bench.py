"""Fast at LLM scale: gradscope on the meta device, cold and warm, against MemTracker under FakeTensorMode.

Two models side by side in one run, in training mode with AdamW:

- GPT-2-medium's shape (24 layers, d=1024, 16 heads, vocabulary 50,257, dropout 0.1, sdpa) at 8 x 1024 tokens;
- Llama-7B's shape (32 layers, d=4096, 32 heads, MLP 11,008, vocabulary 32,000) at 1 x 4096 tokens.

gradscope's time is the forward on ``meta`` under ``kernels_on_meta("cpu")``, ``inspect()`` and
``backward_memory(optimizer=AdamW)``: *cold* with an empty in-node measurement cache (a fresh
``GRADSCOPE_CACHE`` folder), *warm* a second forward on the same model with the cache file read again, as a
new process would. MemTracker's time is the same step (forward, ``backward()``, ``AdamW.step()``) tracked
under ``FakeTensorMode`` on the same model built there. Building the models is timed by neither; a warm-up on
a 1-layer copy of each shape pays the imports of both tools first (torch's and transformers' lazy modules),
so neither side's first call is charged for them; gradscope's warm-up uses a throw-away cache, so the timed
cold run still measures every kernel.

Targets (exit 1 when one is missed): cold at most 0.5x MemTracker's time, warm at most 0.1x, and the
absolute step peak within 1% of MemTracker's (MemTracker sees the tensors each op returns, gradscope also
the kernels' in-node memory, so they are compared where that memory is not at the peak).

    python bench/scale_bench.py                       # both models at the shapes above
    python bench/scale_bench.py --layers 2            # fewer layers (while iterating)
    python bench/scale_bench.py llama --tokens 2048   # one model, fewer tokens
    python bench/scale_bench.py gpt2 --flash-forced   # also the meta context before it asked torch's chooser
    python bench/scale_bench.py --extrapolation       # also in-node memory extrapolated against full size
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")

import gradscope  # noqa: E402
from gradscope.memory import kernels_on_meta  # noqa: E402
from gradscope.memory.kernels import measure, workspace  # noqa: E402
from gradscope.memory.targets import CPU, FLASH, MATH  # noqa: E402

GiB = 2**30
COLD, WARM, PEAK = 0.5, 0.1, 0.01

#: name -> (layers, batch, tokens) at full size
SHAPES = {"gpt2": (24, 8, 1024), "llama": (32, 1, 4096)}


class ForcedFlash(CPU):
    """The meta context before it asked torch's chooser: CPU's flash kernel for every call without a mask."""

    def sdpa_backend(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):  # fmt: skip
        return FLASH if attn_mask is None else MATH


def build(name: str, layers: int, batch: int, tokens: int, **dims):
    """``(model, token ids)`` of the named shape on the current default device (meta, or fake CPU);
    ``dims``: other Llama sizes (``hidden_size=1024``...)."""
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=layers, n_embd=1024, n_head=16, n_positions=tokens)
        cfg._attn_implementation = "sdpa"
        return transformers.GPT2LMHeadModel(cfg).train(), torch.randint(0, cfg.vocab_size, (batch, tokens))
    sizes = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                 vocab_size=32000)  # fmt: skip
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, max_position_embeddings=tokens, **{**sizes, **dims})
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).train(), torch.randint(0, cfg.vocab_size, (batch, tokens))


def gradscope_step(model, ids, target="cpu") -> tuple[float, object]:
    """Seconds for the forward on meta, ``inspect()`` and ``backward_memory(optimizer=AdamW)``; the result."""
    t = time.perf_counter()
    with kernels_on_meta(target):
        loss = model(input_ids=ids, labels=ids).loss
    opt = torch.optim.AdamW(model.parameters())
    bm = gradscope.inspect(loss, model=model).backward_memory(optimizer=opt)
    return time.perf_counter() - t, bm


def cold_warm(model, ids, target="cpu") -> tuple[float, float, object]:
    """(cold seconds, warm seconds, result): cold in a fresh cache folder, warm with its file read again."""
    os.environ["GRADSCOPE_CACHE"] = tempfile.mkdtemp(prefix="gs-scale-")
    workspace._LOADED.clear()
    cold, bm = gradscope_step(model, ids, target)
    workspace._LOADED.clear()  # read the cache file again, as a new process would
    warm, again = gradscope_step(model, ids, target)
    assert again.absolute_peak == bm.absolute_peak, "the warm cache changed the answer"
    return cold, warm, bm


def on_meta(name: str, shape: tuple, **dims):
    with torch.device("meta"):
        return build(name, *shape, **dims)


def memtracker_step(name: str, shape: tuple) -> tuple[float, int]:
    """(seconds, whole-step peak) of MemTracker under FakeTensorMode: forward, backward, AdamW step."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode():
        model, ids = build(name, *shape)
        t = time.perf_counter()
        opt = torch.optim.AdamW(model.parameters())
        mt = MemTracker()
        mt.track_external(model, opt, ids)
        with mt:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        snap = mt.get_tracker_snapshot("peak")
        took = time.perf_counter() - t
    return took, sum(v.get("Total", 0) for v in snap.values())


def warm_up(names: list) -> None:
    """Both tools once on a 1-layer, 64-token copy of each shape (imports and one-time set-up)."""
    for name in names:
        cold_warm(*on_meta(name, (1, 1, 64)))
        memtracker_step(name, (1, 1, 64))


def extrapolation() -> bool:
    """A 2-layer Llama of d=1024 at 512 tokens (its activations above ``measure.LIMIT``): the peak with
    in-node memory extrapolated from small sizes against measured at full size; within 1%."""
    small = dict(hidden_size=1024, intermediate_size=2752, num_attention_heads=8, num_key_value_heads=8)
    limit, peaks = measure.LIMIT, []
    try:
        for label, measure.LIMIT in (("extrapolated", limit), ("full size", 1 << 40)):
            cold, _, bm = cold_warm(*on_meta("llama", (2, 1, 512), vocab_size=8000, **small))
            peaks.append(bm.peak)
            print(f"  Llama 2 x 1024, 512 tokens, {label:<13} cold {cold:6.1f} s  backward peak {bm.peak:,} B")
    finally:
        measure.LIMIT = limit
    diff = (peaks[0] - peaks[1]) / peaks[1]
    print(f"  extrapolated against full size: {diff:+.2%} (target within 1%)")
    return abs(diff) <= PEAK


def main(argv: list) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help="gpt2, llama (default: both)")
    ap.add_argument("--layers", type=int, help="layers of every model (default: its own)")
    ap.add_argument("--tokens", type=int, help="tokens per sequence of every model (default: its own)")
    ap.add_argument("--flash-forced", action="store_true", help="also the meta context that forced flash")
    ap.add_argument("--extrapolation", action="store_true", help="also extrapolated against full-size measuring")
    args = ap.parse_args(argv)
    args.models = args.models or list(SHAPES)
    if set(args.models) - set(SHAPES):
        ap.error(f"unknown model(s) {sorted(set(args.models) - set(SHAPES))}: choose among {list(SHAPES)}")
    warm_up(args.models)
    ok = True
    head = f"{'model':<34} {'cold s':>7} {'warm s':>7} {'MemTr s':>8} {'cold x':>7} {'warm x':>7}"
    print(f"{head} {'gradscope':>10} {'MemTracker':>10} {'difference':>22}")
    for name in args.models:
        layers, batch, tokens = SHAPES[name]
        shape = (args.layers or layers, batch, args.tokens or tokens)
        cold, warm, bm = cold_warm(*on_meta(name, shape))
        took, mt = memtracker_step(name, shape)
        diff = (bm.absolute_peak - mt) / mt
        label = f"{name} {shape[0]} layers, {shape[1]} x {shape[2]} tokens"
        print(f"{label:<34} {cold:>7.1f} {warm:>7.2f} {took:>8.1f} {cold / took:>7.3f} {warm / took:>7.3f} "
              f"{bm.absolute_peak / GiB:>6.2f} GiB {mt / GiB:>6.2f} GiB {bm.absolute_peak - mt:>+14,} B "
              f"{diff:+.2%}")  # fmt: skip
        if bm.unmodelled:
            why = sorted({str(w).split(":")[0] for w in bm.innode_unknown.values()})[:3]
            print(f"  {len(bm.unmodelled)} nodes unmodelled, the peak is a lower bound ({'; '.join(why)})")
        ok &= cold <= COLD * took and warm <= WARM * took and abs(diff) <= PEAK
        if args.flash_forced:
            _, _, old = cold_warm(*on_meta(name, shape), ForcedFlash())
            print(f"  flash forced on meta (before): {old.absolute_peak / GiB:.2f} GiB, "
                  f"{(old.absolute_peak - mt) / mt:+.1%} vs MemTracker")  # fmt: skip
    if args.extrapolation:
        ok &= extrapolation()
    print(f"targets: cold <= {COLD}x MemTracker, warm <= {WARM}x, absolute step peak within {PEAK:.0%}")
    print("OK" if ok else "TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
