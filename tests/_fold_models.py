"""Vision models with torchvision's module names and layouts, written here (torchvision is not installed).

ResNet-18/34 (BasicBlock), ResNet-50 (Bottleneck), DenseNet-121-like and Inception-v3-like (blocks of four
parallel branches of different depths). Random weights, small inputs: the drawing tests only need the
graph's structure and shapes.
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, with its module names (``inplace=False``: its ReLU as ``F.relu``)."""

    def __init__(self, cin: int, cout: int, stride: int = 1, inplace: bool = True):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=inplace)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    """torchvision's ResNet-50 Bottleneck, with its module names (conv1..3, bn1..3, relu, downsample)."""

    def __init__(self, cin: int, mid: int, stride: int = 1):
        super().__init__()
        cout = 4 * mid
        self.conv1 = nn.Conv2d(cin, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """torchvision.models.resnet{18,34,50}'s layout and names (conv1, bn1, layer1.0.conv1, ..., fc)."""

    def __init__(self, blocks=(2, 2, 2, 2), bottleneck: bool = False, width: int = 8, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = width
        for i, n in enumerate(blocks):
            stride, mid = (1 if i == 0 else 2), width * 2**i
            layer = []
            for k in range(n):
                if bottleneck:
                    layer.append(Bottleneck(cin, mid, stride if k == 0 else 1))
                    cin = 4 * mid
                else:
                    layer.append(BasicBlock(cin, mid, stride if k == 0 else 1))
                    cin = mid
            setattr(self, f"layer{i + 1}", nn.Sequential(*layer))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


RESNETS = {
    "resnet18": dict(blocks=(2, 2, 2, 2)),
    "resnet34": dict(blocks=(3, 4, 6, 3)),
    "resnet50": dict(blocks=(3, 4, 6, 3), bottleneck=True),
}


class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, 4 * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(4 * growth)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4 * growth, growth, 3, 1, 1, bias=False)

    def forward(self, features):
        x = self.conv1(self.relu1(self.norm1(torch.cat(features, 1))))
        return self.conv2(self.relu2(self.norm2(x)))


class DenseBlock(nn.ModuleDict):
    def __init__(self, layers: int, cin: int, growth: int):
        super().__init__({f"denselayer{i + 1}": DenseLayer(cin + i * growth, growth) for i in range(layers)})

    def forward(self, x):
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm = nn.BatchNorm2d(cin)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(cin, cout, 1, bias=False)
        self.pool = nn.AvgPool2d(2, 2)


class DenseNet(nn.Module):
    """torchvision.models.densenet121's layout and names (features.denseblock1.denselayer1.conv1, ...)."""

    def __init__(self, blocks=(6, 12, 24, 16), growth: int = 4, init: int = 8, classes: int = 10):
        super().__init__()
        parts: dict = {
            "conv0": nn.Conv2d(3, init, 7, 2, 3, bias=False),
            "norm0": nn.BatchNorm2d(init),
            "relu0": nn.ReLU(inplace=True),
            "pool0": nn.MaxPool2d(3, 2, 1),
        }
        c = init
        for i, n in enumerate(blocks):
            parts[f"denseblock{i + 1}"] = DenseBlock(n, c, growth)
            c += n * growth
            if i != len(blocks) - 1:
                parts[f"transition{i + 1}"] = Transition(c, c // 2)
                c //= 2
        parts["norm5"] = nn.BatchNorm2d(c)
        self.features = nn.Sequential()
        for k, m in parts.items():
            self.features.add_module(k, m)
        self.classifier = nn.Linear(c, classes)

    def forward(self, x):
        x = torch.relu(self.features(x))
        return self.classifier(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class ConvBN(nn.Module):
    """torchvision's BasicConv2d: conv, bn, relu."""

    def __init__(self, cin: int, cout: int, k=1, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, stride, padding, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def _c(n: int) -> int:
    """torchvision's channel count, scaled down 16 times."""
    return max(2, n // 16)


class InceptionA(nn.Module):
    def __init__(self, cin, pool):
        super().__init__()
        self.branch1x1 = ConvBN(cin, _c(64))
        self.branch5x5_1 = ConvBN(cin, _c(48))
        self.branch5x5_2 = ConvBN(_c(48), _c(64), 5, padding=2)
        self.branch3x3dbl_1 = ConvBN(cin, _c(64))
        self.branch3x3dbl_2 = ConvBN(_c(64), _c(96), 3, padding=1)
        self.branch3x3dbl_3 = ConvBN(_c(96), _c(96), 3, padding=1)
        self.branch_pool = ConvBN(cin, pool)

    def forward(self, x):
        b = self.branch5x5_2(self.branch5x5_1(x))
        d = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        p = self.branch_pool(nn.functional.avg_pool2d(x, 3, 1, 1))
        return torch.cat([self.branch1x1(x), b, d, p], 1)


class InceptionB(nn.Module):
    def __init__(self, cin):
        super().__init__()
        self.branch3x3 = ConvBN(cin, _c(384), 3, 2)
        self.branch3x3dbl_1 = ConvBN(cin, _c(64))
        self.branch3x3dbl_2 = ConvBN(_c(64), _c(96), 3, padding=1)
        self.branch3x3dbl_3 = ConvBN(_c(96), _c(96), 3, 2)

    def forward(self, x):
        d = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch3x3(x), d, nn.functional.max_pool2d(x, 3, 2)], 1)


class InceptionC(nn.Module):
    def __init__(self, cin, c7):
        super().__init__()
        self.branch1x1 = ConvBN(cin, _c(192))
        self.branch7x7_1 = ConvBN(cin, c7)
        self.branch7x7_2 = ConvBN(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7_3 = ConvBN(c7, _c(192), (7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = ConvBN(cin, c7)
        self.branch7x7dbl_2 = ConvBN(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = ConvBN(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = ConvBN(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = ConvBN(c7, _c(192), (1, 7), padding=(0, 3))
        self.branch_pool = ConvBN(cin, _c(192))

    def forward(self, x):
        b = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        d = x
        for k in range(1, 6):
            d = getattr(self, f"branch7x7dbl_{k}")(d)
        p = self.branch_pool(nn.functional.avg_pool2d(x, 3, 1, 1))
        return torch.cat([self.branch1x1(x), b, d, p], 1)


class InceptionD(nn.Module):
    def __init__(self, cin):
        super().__init__()
        self.branch3x3_1 = ConvBN(cin, _c(192))
        self.branch3x3_2 = ConvBN(_c(192), _c(320), 3, 2)
        self.branch7x7x3_1 = ConvBN(cin, _c(192))
        self.branch7x7x3_2 = ConvBN(_c(192), _c(192), (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = ConvBN(_c(192), _c(192), (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = ConvBN(_c(192), _c(192), 3, 2)

    def forward(self, x):
        a = self.branch3x3_2(self.branch3x3_1(x))
        b = x
        for k in range(1, 5):
            b = getattr(self, f"branch7x7x3_{k}")(b)
        return torch.cat([a, b, nn.functional.max_pool2d(x, 3, 2)], 1)


class InceptionE(nn.Module):
    def __init__(self, cin):
        super().__init__()
        self.branch1x1 = ConvBN(cin, _c(320))
        self.branch3x3_1 = ConvBN(cin, _c(384))
        self.branch3x3_2a = ConvBN(_c(384), _c(384), (1, 3), padding=(0, 1))
        self.branch3x3_2b = ConvBN(_c(384), _c(384), (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = ConvBN(cin, _c(448))
        self.branch3x3dbl_2 = ConvBN(_c(448), _c(384), 3, padding=1)
        self.branch3x3dbl_3a = ConvBN(_c(384), _c(384), (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = ConvBN(_c(384), _c(384), (3, 1), padding=(1, 0))
        self.branch_pool = ConvBN(cin, _c(192))

    def forward(self, x):
        a = self.branch3x3_1(x)
        a = torch.cat([self.branch3x3_2a(a), self.branch3x3_2b(a)], 1)
        d = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        d = torch.cat([self.branch3x3dbl_3a(d), self.branch3x3dbl_3b(d)], 1)
        p = self.branch_pool(nn.functional.avg_pool2d(x, 3, 1, 1))
        return torch.cat([self.branch1x1(x), a, d, p], 1)


class InceptionV3(nn.Module):
    """torchvision.models.inception_v3's blocks and names (Mixed_5b ... Mixed_7c; A, B, C, D, E blocks of
    four parallel branches of different depths), channels scaled down 16 times, without the aux head."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.Conv2d_1a_3x3 = ConvBN(3, _c(32), 3, 2)
        self.Conv2d_2a_3x3 = ConvBN(_c(32), _c(64), 3, padding=1)
        self.Conv2d_3b_1x1 = ConvBN(_c(64), _c(192))
        c = _c(192)
        self.Mixed_5b = InceptionA(c, _c(32))
        self.Mixed_5c = InceptionA(_c(256), _c(64))
        self.Mixed_5d = InceptionA(_c(288), _c(64))
        self.Mixed_6a = InceptionB(_c(288))
        c = _c(384) + _c(96) + _c(288)
        self.Mixed_6b = InceptionC(c, _c(128))
        self.Mixed_6c = InceptionC(_c(768), _c(160))
        self.Mixed_6d = InceptionC(_c(768), _c(160))
        self.Mixed_6e = InceptionC(_c(768), _c(192))
        self.Mixed_7a = InceptionD(_c(768))
        c = _c(320) + _c(192) + _c(768)
        self.Mixed_7b = InceptionE(c)
        self.Mixed_7c = InceptionE(_c(2048))
        self.fc = nn.Linear(_c(2048), classes)

    def forward(self, x):
        x = nn.functional.max_pool2d(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)), 3, 2)
        x = self.Conv2d_3b_1x1(x)
        for name in ("5b", "5c", "5d", "6a", "6b", "6c", "6d", "6e", "7a", "7b", "7c"):
            x = getattr(self, f"Mixed_{name}")(x)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def loss_of(model, size: int = 32, detach_at: str | None = None):
    """One forward's loss; ``detach_at``: plant a ``.detach()`` on that submodule's output."""
    torch.manual_seed(0)
    handle = None
    if detach_at is not None:
        handle = model.get_submodule(detach_at).register_forward_hook(lambda m, i, out: out.detach())
    try:
        return nn.functional.cross_entropy(model(torch.randn(2, 3, size, size)), torch.tensor([1, 2]))
    finally:
        if handle is not None:
            handle.remove()
