"""Device targets (gradscope/memory/targets/): the CUDA caching allocator's rounding and segments as torch's
source states them (NOTE [CUDA caching allocator]), each device's attention kernel choice, and that every
prediction for a target not measured on its device says so."""

from __future__ import annotations

import contextlib
import itertools
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from click.testing import CliRunner

import gradscope
from gradscope.cli.commands import main
from gradscope.errors import InputTypeError, InputValueError
from gradscope.memory.targets import CPU, CUDA, EFFICIENT, FLASH, MATH, resolve
from gradscope.memory.targets.cuda import cublas_workspace

KiB, MiB = 1024, 1024 * 1024


@pytest.mark.parametrize("asked,counted", [
    (0, 0),                              # an empty tensor takes no block
    (1, 512), (4, 512), (512, 512),      # at least 512 bytes
    (513, 1024), (1000, 1024),           # then multiples of 512
    (MiB, MiB), (MiB + 1, MiB + 512),    # the small pool ends at 1 MiB; 1-10 MiB split 20 MiB segments exactly
    (5 * MiB + 1, 5 * MiB + 512),
    (10 * MiB, 10 * MiB),                # from 10 MiB, a new segment is the request rounded up to 2 MiB ...
    (10 * MiB + 1, 10 * MiB + 512),      # ... and split when more than 1 MiB would remain,
    (11 * MiB + 1, 12 * MiB),            # else counted whole
    (13 * MiB, 14 * MiB), (12 * MiB + 512, 12 * MiB + 512),
])
def test_cuda_allocated_follows_the_caching_allocator(asked, counted):
    assert CUDA().allocated(asked) == counted
    assert CUDA().allocated(counted) == counted       # a block's size is a fixed point
    assert CPU().allocated(asked) == asked


@pytest.mark.parametrize("blocks,reserved", [
    ([], 0),
    ([512] * 10, 2 * MiB),                       # small blocks share 2 MiB segments
    ([MiB] * 3, 4 * MiB),
    ([MiB + 512], 20 * MiB),                     # 1-10 MiB: 20 MiB segments
    ([3 * MiB] * 7, 40 * MiB),
    ([11 * MiB + 1], 12 * MiB),                  # 10 MiB and up: its own segment, 2 MiB rounding
    ([100, 2 * MiB, 20 * MiB], 2 * MiB + 20 * MiB + 20 * MiB),
])
def test_cuda_reserved_estimate_packs_blocks_into_segments(blocks, reserved):
    assert CUDA().reserved(blocks) == reserved
    assert CUDA().reserved(blocks) >= sum(CUDA().allocated(b) for b in blocks)


def test_cublas_workspace_default_and_config():
    assert cublas_workspace((8, 0), None) == 8_519_680      # :4096:2:16:8
    assert cublas_workspace((9, 0), None) == 32 * MiB       # Hopper
    assert cublas_workspace((8, 0), ":4096:8") == 32 * MiB
    assert cublas_workspace((9, 0), ":16:8") == 128 * KiB


def _qkv(dtype=torch.float32, heads=4, kv_heads=4, d=16, n=8, device="meta", requires_grad=True):
    q = torch.randn(2, heads, n, d, dtype=dtype, device=device, requires_grad=requires_grad)
    k = torch.randn(2, kv_heads, n, d, dtype=dtype, device=device, requires_grad=requires_grad)
    v = torch.randn(2, kv_heads, n, d, dtype=dtype, device=device, requires_grad=requires_grad)
    return q, k, v


@pytest.mark.parametrize("dtype,mask,heads,d,want", [
    (torch.bfloat16, None, 4, 64, FLASH),
    (torch.float16, None, 2, 128, FLASH),        # grouped-query heads, with enable_gqa
    (torch.bfloat16, "bool", 4, 64, EFFICIENT),  # flash takes no mask
    (torch.float32, None, 4, 64, EFFICIENT),     # flash is half precision only
    (torch.float32, None, 4, 6, MATH),           # memory-efficient needs the head size a multiple of 4 in float32
    (torch.float32, None, 2, 64, MATH),          # nor grouped-query heads
    (torch.bfloat16, None, 4, 512, EFFICIENT),   # flash: head size at most 256
    (torch.float64, None, 4, 64, MATH),
])
def test_cuda_attention_choice(dtype, mask, heads, d, want):
    q, _, _ = _qkv(dtype, d=d)
    _, k, v = _qkv(dtype, kv_heads=heads, d=d)
    m = torch.ones(8, 8, dtype=torch.bool, device="meta") if mask else None
    assert CUDA().sdpa_backend(q, k, v, attn_mask=m, dropout_p=0.1, enable_gqa=heads != 4) == want


def test_cuda_attention_choice_reads_the_kernel_switches():
    q, k, v = _qkv(torch.bfloat16)
    assert CUDA().sdpa_backend(q, k, v) == FLASH
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
                                         torch.nn.attention.SDPBackend.MATH]):
        assert CUDA().sdpa_backend(q, k, v) == EFFICIENT
    assert CUDA(capability=(7, 5)).sdpa_backend(q, k, v) == EFFICIENT   # flash needs sm80


_GRID = list(itertools.product(
    (torch.float32, torch.bfloat16),
    (None, "bool", "float"),
    (0.0, 0.1),
    (False, True),            # grouped-query heads
    ("contiguous", "last-dim-strided", "3-d"),
))


@pytest.mark.parametrize("dtype,mask,dropout,gqa,layout", _GRID)
def test_cpu_choice_on_stand_ins_equals_what_cpu_runs(dtype, mask, dropout, gqa, layout):
    """The CPU target answers for meta tensors what CPU itself runs for the same arguments (the node
    ``F.scaled_dot_product_attention`` leaves on CPU tensors)."""
    kvh = 2 if gqa else 4
    out = {}
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        q, k, v = _qkv(dtype, kv_heads=kvh, device=device)
        if layout == "last-dim-strided":
            q = torch.randn(2, 4, 16, 8, dtype=dtype, device=device, requires_grad=True).transpose(-1, -2)
        if layout == "3-d":
            q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        m = None
        if mask == "bool":
            m = torch.ones(8, 8, dtype=torch.bool, device=device).tril()
        elif mask == "float":
            m = torch.zeros(8, 8, dtype=dtype, device=device)
        out[device] = (q, k, v, m)
    q, k, v, m = out["cpu"]
    try:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout, enable_gqa=gqa)
    except RuntimeError:
        pytest.skip("CPU refuses these arguments")
    node = o.grad_fn
    if type(node).__name__ == "SqueezeBackward1":  # torch 2.15: 3-d inputs run flash unsqueezed to 4-d
        node = node.next_functions[0][0]
    ran = FLASH if type(node).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0" else MATH
    q, k, v, m = out["meta"]
    assert CPU().sdpa_backend(q, k, v, attn_mask=m, dropout_p=dropout, enable_gqa=gqa) == ran


def test_resolve_names_and_bad_targets():
    assert resolve(None) == CPU() and resolve("cpu") == CPU() and resolve("CUDA") == CUDA()
    t = CUDA(capability=(8, 0))
    assert resolve(t) is t
    with pytest.raises(InputValueError, match="takes 'cpu' or 'cuda'.*'tpu'"):
        resolve("tpu")
    with pytest.raises(InputTypeError, match="got a int"):
        resolve(3)


def _mlp_report():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(100, 300), nn.GELU(), nn.Linear(300, 10))
    with gradscope.trace() as tr:
        loss = m(torch.randn(7, 100)).square().mean()
    return m, gradscope.inspect(loss, model=m, trace=tr)


def test_cuda_target_rounds_each_tensor_and_says_modelled_not_measured():
    m, report = _mlp_report()
    cpu = report.backward_memory(optimizer=torch.optim.AdamW(m.parameters()))
    cuda = report.backward_memory(optimizer=torch.optim.AdamW(m.parameters()), target="cuda")
    rounded = sum(CUDA().allocated(p.numel() * p.element_size()) for p in m.parameters())
    assert cpu.parts["parameters"] == sum(p.numel() * p.element_size() for p in m.parameters())
    assert cuda.parts["parameters"] == rounded != cpu.parts["parameters"]
    assert cuda.parts["cuBLAS workspace (one stream)"] == 32 * MiB
    assert cuda.step.implementation == "foreach" and cpu.step.implementation == "single-tensor"
    assert cuda.step.state_new == 2 * rounded            # exp_avg, exp_avg_sq; the step counters stay on the CPU
    assert cuda.names == cpu.names and cuda.absolute_peak > cpu.absolute_peak
    assert cuda.reserved() >= cuda.parts["parameters"] + 32 * MiB
    assert "modelled, not measured" in str(cuda) and "modelled, not measured" not in str(cpu)
    assert cuda.target == CUDA() and cpu.target == CPU()
    assert ("(seed)", "gradients", 4) in cpu.contributors() and ("(seed)", "gradients", 512) in cuda.contributors()


def test_what_if_and_plan_for_cuda_say_modelled_not_measured():
    m, report = _mlp_report()
    w = report.what_if(batch=2, target="cuda")
    assert "modelled, not measured" in str(w) and w.memory.target == CUDA()
    assert w.before == report.backward_memory(target="cuda").absolute_peak
    p = report.plan(budget="1GiB", target="cuda")
    assert p.fits and "modelled, not measured" in str(p)
    assert report.max_batch(budget="64MiB", target="cuda").batch < report.max_batch(budget="64MiB").batch
    ddp = report.what_if(shard=gradscope.DDP(2), target="cuda")  # per rank on the device: NCCL's part modelled
    assert ddp.device.startswith("cuda") and "NCCL" in str(ddp) and "modelled, not measured" in str(ddp)
    assert ddp.single == report.what_if(target="cuda").peak != report.what_if().peak


_TARGET = """
import torch
from torch import nn

def step():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    return m(torch.randn(128, 64)).pow(2).mean(), m
"""


@contextlib.contextmanager
def _file(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(_TARGET))
    yield str(path)


def test_cli_target_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADSCOPE_CACHE", str(tmp_path / "cache"))
    with _file(tmp_path) as f:
        run = CliRunner().invoke
        cpu = run(main, ["memory", f"{f}:step", "--optimizer", "adamw", "--budget", "16MiB"])
        cuda = run(main, ["memory", f"{f}:step", "--optimizer", "adamw", "--budget", "16MiB", "--target", "cuda"])
        bad = run(main, ["memory", f"{f}:step", "--target", "tpu"])
    assert cpu.exit_code == 0 and "modelled, not measured" not in cpu.output
    assert cuda.exit_code == 1, cuda.output              # the cuBLAS workspace alone is 32 MiB
    assert "modelled, not measured" in cuda.output and "cuBLAS workspace" in cuda.output
    assert bad.exit_code == 2 and "Traceback" not in bad.output and "'tpu'" in bad.output
