"""The model of docs/memory.md: a 6-layer GPT (d=256, context 256, vocabulary 2,000).

    gradscope memory docs/memory_example.py:batch8 --optimizer adamw --budget 768MiB
    gradscope memory docs/memory_example.py:batch32_meta --optimizer adamw --budget 768MiB   # exit 1
"""

import torch
import torch.nn.functional as F
from torch import nn

import gradscope


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=2000, d=256, layers=6, heads=4, ctx=256):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(ctx, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tok):
        x = self.emb(tok) + self.pos[: tok.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def step(batch: int, device: str = "cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT()
        tokens = torch.randint(0, 2000, (batch, 256))
    with gradscope.memory.cpu_kernels_on_meta():     # on meta: the attention kernel CPU would use
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    return loss, model


def batch8():
    return step(8)


def batch32_meta():
    return step(32, "meta")
