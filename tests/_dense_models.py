"""Dense models for the render budget: the DenseNets and Inception-v3 at their published sizes, and random
DAGs with heavy skip connections (a random-wiring network).

torchvision does not import in the project's venv, so the architectures are written here from the papers:
DenseNet (Huang et al. 2017; bottleneck width 4 x growth, compression 0.5) with block configurations
121: (6, 12, 24, 16), 169: (6, 12, 32, 32), 201: (6, 12, 48, 32) at growth 32 and 64 initial features;
161: (6, 12, 36, 24) at growth 48 and 96 initial features; Inception-v3 (Szegedy et al. 2016) with its
stem, three A blocks (35 x 35), the B reduction, four C blocks (17 x 17, factorised 7 x 7), the D
reduction, two E blocks (8 x 8, expanded filter banks) and the auxiliary classifier on the last C block.
Module names follow torchvision's, so a drawing names what a torchvision user sees. Random weights.
"""

from __future__ import annotations

import random

import torch
from torch import nn
from torch.nn import functional as F

from tests._fold_models import DenseNet

__all__ = ["DENSENETS", "densenet", "InceptionV3", "inception_v3", "RandomWiring", "random_dag", "dense_loss"]

#: name -> (block configuration, growth rate, initial features)
DENSENETS = {
    "densenet121": ((6, 12, 24, 16), 32, 64),
    "densenet161": ((6, 12, 36, 24), 48, 96),
    "densenet169": ((6, 12, 32, 32), 32, 64),
    "densenet201": ((6, 12, 48, 32), 32, 64),
}


def densenet(name: str, classes: int = 1000) -> nn.Module:
    """A DenseNet at its published widths (torchvision's ``features.denseblockN.denselayerM`` names)."""
    blocks, growth, init = DENSENETS[name]
    return DenseNet(blocks, growth=growth, init=init, classes=classes)


def dense_loss(model: nn.Module, size: int = 64, batch: int = 2, aux: float = 0.4) -> torch.Tensor:
    """Cross-entropy of one forward on random images; a model that returns ``(logits, aux_logits)``
    (Inception-v3 in training) adds ``aux`` times the auxiliary loss, as its training recipe does."""
    torch.manual_seed(0)
    out = model(torch.randn(batch, 3, size, size))
    y = torch.arange(batch)
    if isinstance(out, tuple) or hasattr(out, "aux_logits"):
        logits, extra = (out[0], out[1]) if isinstance(out, tuple) else (out.logits, out.aux_logits)
        return F.cross_entropy(logits, y) + aux * F.cross_entropy(extra, y)
    return F.cross_entropy(out, y)


class Conv(nn.Module):
    """Inception's basic unit: convolution without bias, batch norm (eps 0.001), ReLU."""

    def __init__(self, cin: int, cout: int, kernel, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


def _convs(module: nn.Module, spec: dict) -> None:
    for name, args in spec.items():
        module.add_module(name, Conv(*args))


class BlockA(nn.Module):
    """35 x 35: 1x1 | 1x1 -> 5x5 | 1x1 -> 3x3 -> 3x3 | avg pool -> 1x1."""

    def __init__(self, cin: int, pool: int):
        super().__init__()
        _convs(self, {"branch1x1": (cin, 64, 1), "branch5x5_1": (cin, 48, 1), "branch5x5_2": (48, 64, 5, 1, 2),
                      "branch3x3dbl_1": (cin, 64, 1), "branch3x3dbl_2": (64, 96, 3, 1, 1),
                      "branch3x3dbl_3": (96, 96, 3, 1, 1), "branch_pool": (cin, pool, 1)})  # fmt: skip

    def forward(self, x):
        five = self.branch5x5_2(self.branch5x5_1(x))
        three = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        pool = self.branch_pool(F.avg_pool2d(x, 3, 1, 1))
        return torch.cat([self.branch1x1(x), five, three, pool], 1)


class BlockB(nn.Module):
    """35 -> 17 reduction: strided 3x3 | 1x1 -> 3x3 -> strided 3x3 | max pool."""

    def __init__(self, cin: int):
        super().__init__()
        _convs(self, {"branch3x3": (cin, 384, 3, 2), "branch3x3dbl_1": (cin, 64, 1),
                      "branch3x3dbl_2": (64, 96, 3, 1, 1), "branch3x3dbl_3": (96, 96, 3, 2)})  # fmt: skip

    def forward(self, x):
        three = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch3x3(x), three, F.max_pool2d(x, 3, 2)], 1)


class BlockC(nn.Module):
    """17 x 17 with 7x7 convolutions factorised into 1x7 and 7x1 (``c7`` channels inside)."""

    def __init__(self, cin: int, c7: int):
        super().__init__()
        row, col = ((1, 7), 1, (0, 3)), ((7, 1), 1, (3, 0))
        _convs(self, {"branch1x1": (cin, 192, 1), "branch7x7_1": (cin, c7, 1), "branch7x7_2": (c7, c7, *row),
                      "branch7x7_3": (c7, 192, *col), "branch7x7dbl_1": (cin, c7, 1),
                      "branch7x7dbl_2": (c7, c7, *col), "branch7x7dbl_3": (c7, c7, *row),
                      "branch7x7dbl_4": (c7, c7, *col), "branch7x7dbl_5": (c7, 192, *row),
                      "branch_pool": (cin, 192, 1)})  # fmt: skip

    def forward(self, x):
        seven = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        dbl = x
        for k in range(1, 6):
            dbl = getattr(self, f"branch7x7dbl_{k}")(dbl)
        pool = self.branch_pool(F.avg_pool2d(x, 3, 1, 1))
        return torch.cat([self.branch1x1(x), seven, dbl, pool], 1)


class BlockD(nn.Module):
    """17 -> 8 reduction: 1x1 -> strided 3x3 | 1x1 -> 1x7 -> 7x1 -> strided 3x3 | max pool."""

    def __init__(self, cin: int):
        super().__init__()
        _convs(self, {"branch3x3_1": (cin, 192, 1), "branch3x3_2": (192, 320, 3, 2), "branch7x7x3_1": (cin, 192, 1),
                      "branch7x7x3_2": (192, 192, (1, 7), 1, (0, 3)), "branch7x7x3_3": (192, 192, (7, 1), 1, (3, 0)),
                      "branch7x7x3_4": (192, 192, 3, 2)})  # fmt: skip

    def forward(self, x):
        three = self.branch3x3_2(self.branch3x3_1(x))
        seven = x
        for k in range(1, 5):
            seven = getattr(self, f"branch7x7x3_{k}")(seven)
        return torch.cat([three, seven, F.max_pool2d(x, 3, 2)], 1)


class BlockE(nn.Module):
    """8 x 8 with expanded filter banks: 1x3 and 3x1 side by side on two branches."""

    def __init__(self, cin: int):
        super().__init__()
        row, col = ((1, 3), 1, (0, 1)), ((3, 1), 1, (1, 0))
        _convs(self, {"branch1x1": (cin, 320, 1), "branch3x3_1": (cin, 384, 1), "branch3x3_2a": (384, 384, *row),
                      "branch3x3_2b": (384, 384, *col), "branch3x3dbl_1": (cin, 448, 1),
                      "branch3x3dbl_2": (448, 384, 3, 1, 1), "branch3x3dbl_3a": (384, 384, *row),
                      "branch3x3dbl_3b": (384, 384, *col), "branch_pool": (cin, 192, 1)})  # fmt: skip

    def forward(self, x):
        a = self.branch3x3_1(x)
        a = torch.cat([self.branch3x3_2a(a), self.branch3x3_2b(a)], 1)
        d = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        d = torch.cat([self.branch3x3dbl_3a(d), self.branch3x3dbl_3b(d)], 1)
        pool = self.branch_pool(F.avg_pool2d(x, 3, 1, 1))
        return torch.cat([self.branch1x1(x), a, d, pool], 1)


class Aux(nn.Module):
    """The auxiliary classifier on the 17 x 17 grid: avg pool 5/3, 1x1 (128), 5x5 (768), linear."""

    def __init__(self, cin: int, classes: int):
        super().__init__()
        self.conv0 = Conv(cin, 128, 1)
        self.conv1 = Conv(128, 768, 5)
        self.fc = nn.Linear(768, classes)

    def forward(self, x):
        x = self.conv1(self.conv0(F.avg_pool2d(x, 5, 3)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class InceptionV3(nn.Module):
    """Inception-v3 at its published widths; in training returns ``(logits, aux_logits)``."""

    def __init__(self, classes: int = 1000, aux: bool = True):
        super().__init__()
        _convs(self, {"Conv2d_1a_3x3": (3, 32, 3, 2), "Conv2d_2a_3x3": (32, 32, 3), "Conv2d_2b_3x3": (32, 64, 3, 1, 1),
                      "Conv2d_3b_1x1": (64, 80, 1), "Conv2d_4a_3x3": (80, 192, 3)})  # fmt: skip
        self.Mixed_5b, self.Mixed_5c, self.Mixed_5d = BlockA(192, 32), BlockA(256, 64), BlockA(288, 64)
        self.Mixed_6a = BlockB(288)
        self.Mixed_6b, self.Mixed_6c = BlockC(768, 128), BlockC(768, 160)
        self.Mixed_6d, self.Mixed_6e = BlockC(768, 160), BlockC(768, 192)
        self.AuxLogits = Aux(768, classes) if aux else None
        self.Mixed_7a = BlockD(768)
        self.Mixed_7b, self.Mixed_7c = BlockE(1280), BlockE(2048)
        self.fc = nn.Linear(2048, classes)

    def forward(self, x):
        x = F.max_pool2d(self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x))), 3, 2)
        x = F.max_pool2d(self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x)), 3, 2)
        for name in ("5b", "5c", "5d", "6a", "6b", "6c", "6d", "6e"):
            x = getattr(self, f"Mixed_{name}")(x)
        aux = self.AuxLogits(x) if self.AuxLogits is not None and self.training else None
        for name in ("7a", "7b", "7c"):
            x = getattr(self, f"Mixed_{name}")(x)
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return logits if aux is None else (logits, aux)


def inception_v3(classes: int = 1000) -> nn.Module:
    return InceptionV3(classes)


class Cell(nn.Module):
    """One node of a random wiring: the sum of its inputs, a linear layer, ReLU."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, inputs):
        total = inputs[0]
        for x in inputs[1:]:
            total = total + x
        return F.relu(self.lin(total))


class RandomWiring(nn.Module):
    """``stages`` stages of ``cells`` cells each (``stageS.cellC``); cell ``c`` reads cell ``c - 1`` and up to
    ``skips`` random earlier cells of its stage (skip connections of every length), and the first cell of
    a stage reads the last of the previous one. Deterministic for a ``seed``."""

    def __init__(self, cells: int = 100, stages: int = 3, skips: int = 3, width: int = 4, seed: int = 0):
        super().__init__()
        rng = random.Random(seed)
        self.wiring: list[list[list[int]]] = []
        for s in range(stages):
            stage = nn.ModuleDict({f"cell{c}": Cell(width) for c in range(cells)})
            self.add_module(f"stage{s + 1}", stage)
            self.wiring.append([sorted({c - 1} | {rng.randrange(c) for _ in range(rng.randint(0, skips))})
                                if c else [] for c in range(cells)])  # fmt: skip
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for s, wires in enumerate(self.wiring):
            stage = getattr(self, f"stage{s + 1}")
            outs: list = []
            for c, cell in enumerate(stage.values()):
                outs.append(cell([outs[i] for i in wires[c]] if wires[c] else [x]))
            x = outs[-1]
        return self.head(x)


def random_dag(cells: int = 100, stages: int = 3, skips: int = 3, seed: int = 0):
    """``(loss, model)`` of a :class:`RandomWiring` on a random batch."""
    torch.manual_seed(seed)
    model = RandomWiring(cells, stages, skips, seed=seed)
    return model(torch.randn(2, 4)).square().mean(), model
