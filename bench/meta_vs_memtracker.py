"""A GPT-2-medium-shaped model asked from the meta device, against torch's MemTracker under FakeTensorMode.

GPT-2-medium's shape (24 layers, d=1024, 16 heads, vocabulary 50,257, default dropout 0.1, training mode),
``layers`` x ``batch`` x ``seq`` from the command line (default 24 8 1024), AdamW: the absolute step peak of
``backward_memory()`` on a meta forward under ``kernels_on_meta("cpu")``, and under a target that forces
CPU's flash attention whatever the dropout (what the meta context did before it asked torch's chooser),
against ``MemTracker``'s whole-step peak under ``FakeTensorMode`` on the same model. Target: within 1% of
MemTracker; exit 1 when missed. Nothing is allocated at full size (meta and fake tensors; the workspace
calibration measures small CPU tensors).

    python bench/meta_vs_memtracker.py [layers batch seq]
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gradscope
from gradscope.memory import kernels_on_meta
from gradscope.memory.targets import CPU, FLASH, MATH

warnings.filterwarnings("ignore")
GiB = 2**30
TARGET = 0.01


class ForcedFlash(CPU):
    """The old meta context: CPU's flash kernel for every call without a mask, dropout or not."""

    def sdpa_backend(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
        return FLASH if attn_mask is None else MATH


def _config(layers: int):
    import transformers

    cfg = transformers.GPT2Config(n_layer=layers, n_embd=1024, n_head=16, n_positions=1024)
    cfg._attn_implementation = "sdpa"
    return cfg


def meta_peak(layers: int, batch: int, seq: int, target) -> tuple[int, float, int]:
    import transformers

    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(_config(layers)).train()
        tok = torch.randint(0, 50257, (batch, seq))
    with kernels_on_meta(target):
        loss = model(input_ids=tok, labels=tok).loss
    t = time.perf_counter()
    bm = gradscope.inspect(loss, model=model).backward_memory(optimizer=torch.optim.AdamW(model.parameters()))
    flash = sum(n == "ScaledDotProductFlashAttentionForCpuBackward0" for n in bm.names)
    return bm.absolute_peak, time.perf_counter() - t, flash


def memtracker_peak(layers: int, batch: int, seq: int) -> tuple[int, float]:
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    t = time.perf_counter()
    with FakeTensorMode():
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(_config(layers)).train()
        tok = torch.randint(0, 50257, (batch, seq))
        opt = torch.optim.AdamW(model.parameters())
        mt = MemTracker()
        mt.track_external(model, opt, tok)
        with mt:
            model(input_ids=tok, labels=tok).loss.backward()
            opt.step()
        snap = mt.get_tracker_snapshot("peak")
    return sum(v.get("Total", 0) for v in snap.values()), time.perf_counter() - t


def main(argv: list[str]) -> int:
    layers, batch, seq = (int(a) for a in argv[:3]) if len(argv) >= 3 else (24, 8, 1024)
    old, t_old, f_old = meta_peak(layers, batch, seq, ForcedFlash())
    new, t_new, f_new = meta_peak(layers, batch, seq, "cpu")
    mt, t_mt = memtracker_peak(layers, batch, seq)
    err = (new - mt) / mt
    print(f"GPT-2-medium shape, {layers} layers, {batch} x {seq} tokens, AdamW, training mode (dropout 0.1)")
    print(f"  meta, flash forced (before):     {old / GiB:8.2f} GiB  {old - mt:+,} B vs MemTracker "
          f"({(old - mt) / mt:+.1%}); flash nodes {f_old}; replay {t_old:.1f} s")
    print(f"  meta, kernels_on_meta('cpu'):    {new / GiB:8.2f} GiB  {new - mt:+,} B vs MemTracker "
          f"({err:+.2%}); flash nodes {f_new}; replay {t_new:.1f} s")
    print(f"  MemTracker under FakeTensorMode: {mt / GiB:8.2f} GiB  ({t_mt:.1f} s)")
    if abs(err) > TARGET:
        print(f"missed: more than {TARGET:.0%} from MemTracker")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
