"""Small models with cuts inside their compiled code, for tests/compiled (torch's ``.grad`` is the judge).

Each model's ``forward`` leaves a known set of parameters without a gradient: cut by ``.detach()``,
``torch.no_grad()``, ``.data``, a module never called, or a graph break through numpy.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn


class MLP(nn.Module):
    """``fc2`` runs under no_grad, ``aux`` is never called."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3, self.aux = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 1), nn.Linear(6, 6)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        with torch.no_grad():
            g = self.fc2(h)
        return self.fc3(h + g).square().mean()


class Attention(nn.Module):
    """A pre-LN attention block whose keys are ``.detach()``ed: ``k`` gets no gradient."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.ln, self.heads = nn.LayerNorm(d), heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln(x)
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        att = torch.nn.functional.scaled_dot_product_attention(q, k.detach(), v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, t, d))
        return (x + self.mlp(x)).square().mean()


class ConvNet(nn.Module):
    """Conv-BN-ReLU twice, a ``skip`` branch cut by ``.data``; ``graph_break`` splits it in two regions."""

    def __init__(self, graph_break=False):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.skip, self.head = nn.Conv2d(3, 4, 1), nn.Linear(4, 2)
        self.graph_break = graph_break

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        if self.graph_break:
            torch._dynamo.graph_break()
        h = torch.relu(self.bn2(self.conv2(h))) + self.skip(x).data
        return self.head(h.mean((2, 3))).square().mean()


class ThroughNumpy(nn.Module):
    """A graph break through numpy mid-forward: ``first``'s output leaves autograd in ``.numpy()``."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        h = self.first(x)
        h = torch.from_numpy(np.tanh(h.detach().numpy()))
        return self.second(h).square().mean()


class HFHead(nn.Module):
    """A 1-layer GPT-2 whose hidden states are ``.detach()``ed before a trainable head: every
    ``gpt.*`` parameter gets no gradient, ``head`` trains."""

    def __init__(self):
        super().__init__()
        import transformers

        transformers.logging.set_verbosity_error()
        cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=8, vocab_size=32,
                                      bos_token_id=0, eos_token_id=0)  # fmt: skip
        self.gpt, self.head = transformers.GPT2Model(cfg), nn.Linear(16, 2)

    def forward(self, ids):
        h = self.gpt(ids).last_hidden_state.detach()
        return self.head(h).square().mean()


class HFLM(nn.Module):
    """A 1-layer GPT-2 LM, healthy (every parameter trains): no finding is the right answer."""

    def __init__(self):
        super().__init__()
        import transformers

        transformers.logging.set_verbosity_error()
        cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=8, vocab_size=32,
                                      bos_token_id=0, eos_token_id=0)  # fmt: skip
        self.lm = transformers.GPT2LMHeadModel(cfg)

    def forward(self, ids):
        return self.lm(ids, labels=ids).loss


def example(model) -> torch.Tensor:
    """The input each model takes."""
    g = torch.Generator().manual_seed(0)
    if isinstance(model, (HFHead, HFLM)):
        return torch.randint(0, 32, (2, 8), generator=g)
    if isinstance(model, Attention):
        return torch.randn(2, 4, 8, generator=g)
    if isinstance(model, ConvNet):
        return torch.randn(2, 3, 6, 6, generator=g)
    if isinstance(model, ThroughNumpy):
        return torch.randn(2, 4, generator=g)
    return torch.randn(3, 6, generator=g)
