"""Models and configurations shared by the sharding truth runs (``_shardtruth.py``) and the predictions."""

from __future__ import annotations

import torch
from torch import nn

from tests import _plan_models as plan_models


class Block(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class MLPStack(nn.Module):
    """``blocks.0`` .. ``blocks.{n-1}`` residual MLP blocks and a ``head``."""

    def __init__(self, d: int = 64, hidden: int = 256, n: int = 4, out: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(n))
        self.head = nn.Linear(d, out)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Attention(plan_models.Attention):
    """The plan tests' attention layers, computed by ``scaled_dot_product_attention``."""

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small transformer: ``emb`` and ``head`` at the root, ``blocks.*`` the sharded blocks."""

    def __init__(self, vocab: int = 101, d: int = 64, heads: int = 4, n: int = 3, seq: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(TBlock(d, heads) for _ in range(n))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tok):
        x = self.emb(tok)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


class Llama(nn.Module):
    """HF Llama from a tiny config (random weights), returning the logits; ``model.layers.*`` sharded."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        cfg._attn_implementation = "sdpa"
        self.lm = LlamaForCausalLM(cfg)

    def forward(self, tok):
        return self.lm(input_ids=tok, use_cache=False).logits


#: the modules each model passes to fully_shard before the root
SHARDED = {"mlp": "blocks.*", "gpt": "blocks.*", "llama": "lm.model.layers.*"}


def build(name: str, **kw) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return MLPStack(**kw)
    if name == "gpt":
        return GPT(**kw)
    if name == "llama":
        return Llama()
    raise ValueError(name)


def batch(name: str, n: int, seed: int = 1, **kw):
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return torch.randn(n, kw.get("d", 64), generator=g)
    return torch.randint(0, 100, (n, 16), generator=g)


def loss_of(out):
    return out.float().pow(2).mean()
