"""Bench models shared by every ``bench/*_bench.py`` script.

Each builder runs one forward pass and returns ``(loss, model)``: ``loss`` is a scalar tensor whose autograd
graph is ready to inspect (no backward has run), ``model`` the ``nn.Module`` that names its parameters.

>>> loss, model = mlp()
>>> loss.shape
torch.Size([])
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tests._fold_models import BasicBlock  # torchvision's block (ReLU not in place here, as F.relu was)
from tests._plan_models import GPT  # the tied-embedding GPT of the plan tests, here at GPT-2-small's size

__all__ = ["mlp", "resnet18_like", "gpt2_small_like", "lstm_unrolled", "deep_transformer", "chain",
           "MODELS"]


def mlp(width: int = 256, depth: int = 4, batch: int = 32, device: str = "cpu"):
    """A ReLU MLP: ``depth`` Linear layers of ``width`` units, MSE loss."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width if i < depth - 1 else 10))
        if i < depth - 1:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers).to(device)
    x = torch.randn(batch, width, device=device)
    return model(x).pow(2).mean(), model


class _ResNet(nn.Module):
    def __init__(self, width: int = 64, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        blocks = []
        cin = width
        for i, cout in enumerate((width, width * 2, width * 4, width * 8)):
            for j in range(2):
                blocks.append(BasicBlock(cin, cout, 2 if (i > 0 and j == 0) else 1, inplace=False))
                cin = cout
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(x.mean(dim=(2, 3)))


def resnet18_like(batch: int = 2, size: int = 32, width: int = 64, device: str = "cpu"):
    """ResNet-18's layout (stem, 4 stages of 2 basic blocks, linear head) on ``size``-pixel images."""
    model = _ResNet(width).to(device)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.zeros(batch, dtype=torch.long, device=device)
    return F.cross_entropy(model(x), y), model


def gpt2_small_like(n_layer: int = 12, d: int = 768, heads: int = 12, vocab: int = 50257, ctx: int = 64,
                    batch: int = 1, device: str = "meta"):
    """A GPT-2-small-like decoder (tied embeddings); on the ``meta`` device by default (real shapes, no data)."""
    with torch.device(device):                       # build on the device: no 150 MB CPU init on meta
        model = GPT(n_layer, d, heads, vocab, ctx)
    idx = torch.zeros(batch, ctx, dtype=torch.long, device=device)
    logits = model(idx)
    return F.cross_entropy(logits.view(-1, vocab), idx.view(-1)), model


class _LSTM(nn.Module):
    def __init__(self, d_in: int, hidden: int):
        super().__init__()
        self.cell = nn.LSTMCell(d_in, hidden)
        self.head = nn.Linear(hidden, 1)


def lstm_unrolled(steps: int = 200, d_in: int = 16, hidden: int = 32, batch: int = 4, device: str = "cpu"):
    """An ``nn.LSTMCell`` unrolled over ``steps`` time steps: the same weights are used at every step."""
    model = _LSTM(d_in, hidden).to(device)
    xs = torch.randn(steps, batch, d_in, device=device)
    h = torch.zeros(batch, hidden, device=device)
    c = torch.zeros(batch, hidden, device=device)
    for t in range(steps):
        h, c = model.cell(xs[t], (h, c))
    return model.head(h).pow(2).mean(), model


def deep_transformer(layers: int = 96, d: int = 32, heads: int = 4, seq: int = 8, batch: int = 2,
                     device: str = "cpu"):
    """``nn.TransformerEncoder`` with ``layers`` small layers, train mode (dropout on)."""
    with torch.device(device):
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=2 * d, batch_first=True)
        model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    model.train()
    x = torch.randn(batch, seq, d, device=device)
    return model(x).pow(2).mean(), model


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))


def chain(n: int = 10_000, device: str = "cpu"):
    """A chain of ``n`` elementwise ops after one parameter: a graph ``n`` nodes deep and one node wide."""
    model = _Scale().to(device)
    y = model.weight * 1.0
    for i in range(n - 1):
        y = y.sin() if i % 2 else y * 1.0001
    return y.sum(), model


#: name -> builder, in the order benches print them.
MODELS = {
    "mlp": mlp,
    "resnet18_like": resnet18_like,
    "gpt2_small_like": gpt2_small_like,
    "lstm_unrolled_200": lstm_unrolled,
    "deep_transformer_96": deep_transformer,
    "chain_10k": chain,
}
