"""A 7B-shaped decoder (Llama-7B's sizes: 32 layers, hidden 4096, MLP 11008, vocab 32000) at world size 8
under FSDP2, predicted on the meta device (no memory used, nothing runs on 8 ranks).

    python docs/sharding_example.py
"""

import time

import torch
import torch.nn.functional as F
from torch import nn

import gradscope


class Layer(nn.Module):
    def __init__(self, d=4096, hidden=11008, heads=32):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    def __init__(self, vocab=32000, d=4096, n=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.Sequential(*(Layer(d) for _ in range(n)))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tok):
        return self.head(self.norm(self.layers(self.embed(tok))))


t0 = time.perf_counter()
with torch.device("meta"):
    model = Decoder()
    tok = torch.randint(0, 32000, (1, 2048))
with gradscope.memory.cpu_kernels_on_meta(), gradscope.trace(model) as tr:
    loss = F.cross_entropy(model(tok).flatten(0, 1), tok.flatten())
report = gradscope.inspect(loss, model=model, trace=tr)
opt = torch.optim.AdamW(model.parameters())
t1 = time.perf_counter()
wi = report.what_if(optimizer=opt, shard=gradscope.FSDP(8, modules=["layers.*"]), checkpoint="layers.*")
t2 = time.perf_counter()
print(wi)
print(f"\nbuild + forward on meta + inspect {t1 - t0:.1f} s; the per-rank prediction {t2 - t1:.1f} s")
