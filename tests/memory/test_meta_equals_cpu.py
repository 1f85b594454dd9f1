"""The meta device answers the question of the CPU run it stands for (docs/memory.md, "Asking from the meta
device"; NOTE [meta graphs] in gradscope/memory/meta.py).

Each model is built twice from the same seed, on CPU and on ``meta``, its forward run under ``trace()`` and
``kernels_on_meta("cpu")``; ``backward_memory()`` of both must agree. Measured on torch 2.13: the same node
order, every level and both peaks identical to the byte on every model here (the tolerance is 0), except that
the math attention path reshapes through ``ReshapeAliasBackward0`` on CPU where meta shows
``ViewBackward0``: both are views that allocate nothing, so the names are compared with that one alias
folded. Without the context, attention models differ (the first test shows by how much), which is what the
context is for.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradscope
from gradscope.memory import cpu_kernels_on_meta, kernels_on_meta

warnings.filterwarnings("ignore", message=".*bos_token_id.*|.*eos_token_id.*|.*loss_type.*")

_ALIAS = {"ReshapeAliasBackward0": "ViewBackward0"}


class Attention(nn.Module):
    """One attention block around ``F.scaled_dot_product_attention`` with the given options."""

    def __init__(self, d=32, heads=4, kv_heads=4, dropout=0.0, mask=None, causal=False):
        super().__init__()
        self.heads, self.kv, self.drop, self.mask, self.causal = heads, kv_heads, dropout, mask, causal
        hd = d // heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, kv_heads * hd), nn.Linear(d, kv_heads * hd)
        self.o = nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        hd = d // self.heads
        q = self.q(x).view(b, n, self.heads, hd).transpose(1, 2)
        k = self.k(x).view(b, n, self.kv, hd).transpose(1, 2)
        v = self.v(x).view(b, n, self.kv, hd).transpose(1, 2)
        m = None
        if self.mask == "bool":
            m = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        elif self.mask == "float":
            m = torch.zeros(b, 1, n, n, device=x.device)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=m, dropout_p=self.drop if self.training else 0.0, is_causal=self.causal,
            enable_gqa=self.kv != self.heads,
        )
        return self.o(o.transpose(1, 2).reshape(b, n, d))


def _block(**kw):
    def build():
        return Attention(**kw), (torch.randn(2, 16, 32),), lambda m, x: m(x).square().mean()
    return build


def _conv_channels_last():
    m = nn.Sequential(
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 7, padding=3, groups=16), nn.GELU(), nn.Conv2d(16, 8, 1), nn.MaxPool2d(2),
    ).to(memory_format=torch.channels_last)
    x = torch.randn(4, 8, 16, 16).to(memory_format=torch.channels_last)
    return m, (x,), lambda m, x: m(x).square().mean()


def _hf(kind):
    def build():
        import transformers

        if kind == "gpt2":  # the default config's dropout (0.1) in training mode
            cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)
            cls, extra = transformers.GPT2LMHeadModel, {}
        else:
            cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, max_position_embeddings=32, num_labels=3)
            cls, extra = transformers.BertForSequenceClassification, {"labels": torch.randint(0, 3, (2,))}
        cfg._attn_implementation = "sdpa"
        m = cls(cfg).train()
        tok = torch.randint(0, 64, (2, 12))
        labels = extra.get("labels", tok)
        return m, (tok, labels), lambda m, t, y: m(input_ids=t, labels=y).loss
    return build


MODELS = {
    "hf_gpt2_dropout": _hf("gpt2"),
    "hf_bert_dropout": _hf("bert"),
    "sdpa_dropout": _block(dropout=0.1),
    "sdpa_dropout_causal": _block(dropout=0.1, causal=True),
    "sdpa_bool_mask": _block(mask="bool"),
    "sdpa_float_mask": _block(mask="float"),
    "sdpa_bool_mask_dropout": _block(mask="bool", dropout=0.1),
    "sdpa_grouped_query_heads": _block(kv_heads=2),
    "conv_channels_last": _conv_channels_last,
}


def _predict(build, device, context=cpu_kernels_on_meta):
    torch.manual_seed(0)
    with torch.device(device):
        model, inputs, loss_fn = build()
    model.train()
    with gradscope.trace() as tr, context():
        loss = loss_fn(model, *inputs)
    report = gradscope.inspect(loss, model=model, trace=tr)
    return report.backward_memory(optimizer=torch.optim.AdamW(model.parameters()))


@pytest.mark.parametrize("name", list(MODELS))
def test_meta_equals_cpu(name):
    cpu, meta = _predict(MODELS[name], "cpu"), _predict(MODELS[name], "meta")
    assert [_ALIAS.get(n, n) for n in meta.names] == [_ALIAS.get(n, n) for n in cpu.names]
    assert meta.levels == cpu.levels                      # tolerance 0 bytes, as measured
    assert meta.peak == cpu.peak and meta.end == cpu.end
    assert meta.absolute_peak == cpu.absolute_peak


def test_meta_without_the_context_is_wrong_where_the_context_is_needed():
    """The question the context answers: on meta, attention is math whatever CPU would run."""
    cpu = _predict(MODELS["sdpa_bool_mask"], "cpu")
    bare = _predict(MODELS["sdpa_bool_mask"], "meta", context=torch.enable_grad)
    assert "ScaledDotProductFlashAttentionForCpuBackward0" in cpu.names
    assert "ScaledDotProductFlashAttentionForCpuBackward0" not in bare.names and bare.peak != cpu.peak


def test_dropout_takes_the_math_path_on_cpu_and_on_meta():
    """CPU runs the math path as soon as dropout_p > 0: a softmax over the whole attention matrix, then the
    dropout mask multiplied in."""
    cpu = _predict(MODELS["sdpa_dropout"], "cpu")
    meta = _predict(MODELS["sdpa_dropout"], "meta")
    for bm in (cpu, meta):
        assert "SafeSoftmaxBackward0" in bm.names and "ScaledDotProductFlashAttentionForCpuBackward0" not in bm.names


def test_cuda_target_on_meta_builds_the_cuda_attention_graph():
    """kernels_on_meta("cuda"): half-precision attention without a mask takes CUDA's flash kernel (saves a
    log-sum-exp and the RNG state), a masked float32 one the memory-efficient kernel."""
    torch.manual_seed(0)
    names = {}
    for dtype, mask in ((torch.bfloat16, None), (torch.float32, "bool")):
        with torch.device("meta"):
            m = Attention(mask=mask, dropout=0.1).to(dtype)
            x = torch.randn(2, 16, 32, dtype=dtype)
        with kernels_on_meta("cuda"):
            loss = m(x).float().square().mean()
        names[dtype] = gradscope.inspect(loss, model=m).backward_memory(target="cuda").names
    assert "ScaledDotProductFlashAttentionBackward0" in names[torch.bfloat16]
    assert "ScaledDotProductEfficientAttentionBackward0" in names[torch.float32]
