"""The built-in example behind ``gradscope demo``: a small two-head classifier with two planted bugs.

Both functions take no arguments and return ``(loss, model)``, so they work as CLI targets::

    gradscope check gradscope.demo:buggy     # exit 1: two error findings
    gradscope check gradscope.demo:fixed     # exit 0

The bugs, each one a mistake that is easy to make and silent until training misbehaves:

1. ``self.aux_head(h).detach()``: the author meant to stop the auxiliary loss from training the encoder
   (``self.aux_head(h.detach())``) but detached the head's *output*, so ``aux_head`` never gets a
   gradient (``unused-parameter``, or ``detached-branch`` with the source line under ``trace()``).
2. ``prob.clamp_(EPS, 1 - EPS)``: clamping the sigmoid's output in place, but ``SigmoidBackward0``
   saved that very tensor, so ``backward()`` raises "modified by an inplace operation"
   (``inplace-hazard``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TwoHeadClassifier", "buggy", "fixed"]

EPS = 1e-6


class TwoHeadClassifier(nn.Module):
    """Binary classifier with an auxiliary 4-way head; ``fixed=False`` plants the two bugs.

    Args:
        fixed: build the corrected forward pass instead of the buggy one.
    """

    def __init__(self, fixed: bool = False, features: int = 16, hidden: int = 32):
        super().__init__()
        self.fixed = fixed
        self.encoder = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.classifier = nn.Linear(hidden, 1)
        self.aux_head = nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.encoder(x)
        prob = torch.sigmoid(self.classifier(h))
        if self.fixed:
            aux = self.aux_head(h.detach())  # stop-gradient into the encoder only
            prob = prob.clamp(EPS, 1 - EPS)  # out of place: the saved output stays intact
        else:
            aux = self.aux_head(h).detach()  # BUG 1: detaches the head's output
            prob.clamp_(EPS, 1 - EPS)  # BUG 2: modifies SigmoidBackward0's saved output
        return prob.squeeze(1), aux


def _batch(features: int = 16, batch: int = 8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, features, generator=g)
    y = torch.randint(0, 2, (batch,), generator=g).float()
    labels = torch.randint(0, 4, (batch,), generator=g)
    return x, y, labels


def _loss(fixed: bool) -> tuple[torch.Tensor, TwoHeadClassifier]:
    with torch.random.fork_rng(devices=[]):  # same weights every call, global RNG untouched
        torch.manual_seed(0)
        model = TwoHeadClassifier(fixed=fixed)
    x, y, labels = _batch()
    prob, aux = model(x)
    loss = F.binary_cross_entropy(prob, y) + 0.1 * F.cross_entropy(aux, labels)
    return loss, model


def buggy() -> tuple[torch.Tensor, TwoHeadClassifier]:
    """The loss and model of the buggy classifier (call ``inspect`` before ``backward()``).

    Returns:
        ``(loss, model)``: ``loss.backward()`` would raise, and ``model.aux_head`` gets no gradient.

    Example:
        >>> import gradscope
        >>> from gradscope.demo import buggy
        >>> loss, model = buggy()
        >>> sorted(f.kind for f in gradscope.inspect(loss, model=model).findings)
        ['inplace-hazard', 'unused-parameter']
    """
    return _loss(fixed=False)


def fixed() -> tuple[torch.Tensor, TwoHeadClassifier]:
    """The same classifier with both bugs fixed: every parameter gets a gradient.

    Example:
        >>> import gradscope
        >>> from gradscope.demo import fixed
        >>> loss, model = fixed()
        >>> gradscope.inspect(loss, model=model).findings
        []
    """
    return _loss(fixed=True)
