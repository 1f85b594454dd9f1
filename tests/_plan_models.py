"""Small models for the what-if / plan tests and bench: each builder returns ``(model, inputs, loss_fn)``.

``loss_fn(model, *inputs)`` runs the forward and returns a scalar loss. Batch is the first argument of every
builder, so ``build(2 * b)`` is the "batch x2" step. ``CASES`` lists, per model, the module sets a what-if
checkpoints and offloads.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT with tied embeddings (``wte`` is used twice: a shared parameter)."""

    def __init__(self, n_layer, d, heads, vocab, ctx):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks(self.wte(idx) + self.wpe(pos))
        return self.ln_f(x) @ self.wte.weight.t()


def _lm_loss(model, idx):
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx.reshape(-1))


def gpt(batch=8, n_layer=4, d=64, heads=4, vocab=256, ctx=64, device="cpu"):
    with torch.device(device):
        model = GPT(n_layer, d, heads, vocab, ctx)
    idx = torch.randint(0, vocab, (batch, ctx), device=device)
    return model, (idx,), _lm_loss


def gpt_tiny(batch=4, device="cpu"):
    return gpt(batch, n_layer=2, d=32, heads=2, vocab=128, ctx=32, device=device)


def gpt_wide(batch=4, device="cpu"):
    return gpt(batch, n_layer=3, d=128, heads=4, vocab=512, ctx=128, device=device)


def _mse(model, x, y):
    return F.mse_loss(model(x), y)


def encoder(batch=8, layers=3, d=48, heads=4, seq=48, device="cpu", norm_first=True):
    """``nn.TransformerEncoder``, pre-LN by default (dropout off so that recompute is deterministic)."""
    with torch.device(device):
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True, norm_first=norm_first)
        model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    x = torch.randn(batch, seq, d, device=device)
    return model, (x, torch.randn(batch, seq, d, device=device)), _mse


class ResBlock(nn.Module):
    def __init__(self, c, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(c if stride == 1 else c // 2, c, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.down = None if stride == 1 else nn.Conv2d(c // 2, c, 1, stride, bias=False)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, c=16, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.layer1 = nn.Sequential(ResBlock(c), ResBlock(c))
        self.layer2 = nn.Sequential(ResBlock(2 * c, 2), ResBlock(2 * c))
        self.fc = nn.Linear(2 * c, classes)

    def forward(self, x):
        return self.fc(self.layer2(self.layer1(self.stem(x))).mean(dim=(2, 3)))


def _ce(model, x, y):
    return F.cross_entropy(model(x), y)


def resnet(batch=8, size=16, device="cpu"):
    with torch.device(device):
        model = ResNet()
    model.eval()        # BatchNorm in eval: running stats stay put, so a recompute is identical
    x = torch.randn(batch, 3, size, size, device=device)
    return model, (x, torch.randint(0, 10, (batch,), device=device)), _ce


class LSTMNet(nn.Module):
    def __init__(self, d_in=16, hidden=32, layers=2):
        super().__init__()
        self.proj = nn.Linear(d_in, hidden)
        self.rnn = nn.LSTM(hidden, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, 4)

    def forward(self, x):
        out, _ = self.rnn(torch.tanh(self.proj(x)))
        return self.head(out[:, -1])


def lstm(batch=16, seq=40, device="cpu"):
    with torch.device(device):
        model = LSTMNet()
    x = torch.randn(batch, seq, 16, device=device)
    return model, (x, torch.randn(batch, 4, device=device)), _mse


class SharedMLP(nn.Module):
    """One Linear applied three times (weight sharing) between two distinct layers."""

    def __init__(self, d=64):
        super().__init__()
        self.inp = nn.Linear(32, d)
        self.shared = nn.Sequential(nn.Linear(d, d), nn.GELU())
        self.out = nn.Linear(d, 8)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(3):
            h = h + self.shared(h)
        return self.out(h)


def shared_mlp(batch=256, device="cpu"):
    with torch.device(device):
        model = SharedMLP()
    x = torch.randn(batch, 32, device=device)
    return model, (x, torch.randn(batch, 8, device=device)), _mse


def mlp(batch=512, width=128, depth=4, device="cpu"):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    with torch.device(device):
        model = nn.Sequential(*layers, nn.Linear(width, 10))
    x = torch.randn(batch, width, device=device)
    return model, (x, torch.randn(batch, 10, device=device)), _mse


#: name -> (builder, modules to checkpoint, modules to offload) for the what-if tests.
CASES = {
    "gpt_tiny": (gpt_tiny, ["blocks.*"], ["blocks.0"]),
    "gpt": (gpt, ["blocks.1", "blocks.2"], ["blocks.3.mlp"]),
    "gpt_wide": (gpt_wide, ["blocks.0", "blocks.2"], ["blocks.1"]),
    "encoder": (encoder, ["layers.*"], ["layers.0"]),
    "resnet": (resnet, ["layer1.*"], ["layer2.0"]),
    "lstm": (lstm, ["rnn"], ["proj"]),
    "shared_mlp": (shared_mlp, ["shared"], ["inp"]),
    "mlp": (mlp, ["2", "4"], ["0"]),
}
