"""Vision models for ``trace_bench.py``, built from Hugging Face transformers configs with random weights
(no download) or by hand: the families on which a traced forward cost most in the model sweep (Swin-T,
ResNet-50-D, EfficientNet, RegNetY, SK-ResNet, ConvNeXt). torchvision and timm are not needed.

Each builder returns ``(model, forward)``: ``forward()`` runs the model on one batch and returns a scalar
loss. Images are 2 x 3 x 128 x 128 (Swin-T: 224 x 224, its own size, eager attention), so one repeat of
the bench takes seconds on one CPU thread; smaller images make the per-op cost of tracing weigh more,
not less.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["VISION"]


def _hf(config_cls: str, model_cls: str, size: int = 128, **config):
    import transformers

    cfg = getattr(transformers, config_cls)(num_labels=10, **config)
    model = getattr(transformers, model_cls)(cfg)
    x = torch.randn(2, 3, size, size)
    y = torch.tensor([1, 2])
    return model, lambda: F.cross_entropy(model(pixel_values=x).logits, y)


def resnet50_d():
    """ResNet-50 (bottlenecks 3-4-6-3) with the D variant's deep stem and average-pool downsampling
    (``downsample_in_bottleneck``: the stride on the 3x3 conv)."""
    return _hf("ResNetConfig", "ResNetForImageClassification", layer_type="bottleneck",
               depths=[3, 4, 6, 3], hidden_sizes=[256, 512, 1024, 2048], downsample_in_bottleneck=True)


def swin_t():
    return _hf("SwinConfig", "SwinForImageClassification", size=224, embed_dim=96, depths=[2, 2, 6, 2],
               num_heads=[3, 6, 12, 24], window_size=7, image_size=224, attn_implementation="eager")


def efficientnet_b0():
    return _hf("EfficientNetConfig", "EfficientNetForImageClassification", image_size=128)


def regnet_y():
    """RegNetY (squeeze-excitation in every block), 3.2GF-like widths."""
    return _hf("RegNetConfig", "RegNetForImageClassification", layer_type="y", depths=[2, 5, 13, 1],
               hidden_sizes=[72, 216, 576, 1512], groups_width=24)


def convnext_t():
    return _hf("ConvNextConfig", "ConvNextForImageClassification", depths=[3, 3, 9, 3],
               hidden_sizes=[96, 192, 384, 768])


class _SK(nn.Module):
    """A selective-kernel convolution (SKNet): two branches (3x3 and dilated 3x3), fused by attention."""

    def __init__(self, c: int, r: int = 8):
        super().__init__()
        self.branches = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, c, 3, padding=d, dilation=d, groups=max(1, c // 32), bias=False),
                          nn.BatchNorm2d(c), nn.ReLU(inplace=True)) for d in (1, 2))
        hidden = max(32, c // r)
        self.reduce = nn.Sequential(nn.Linear(c, hidden), nn.ReLU(inplace=True))
        self.select = nn.Linear(hidden, 2 * c)

    def forward(self, x):
        feats = torch.stack([b(x) for b in self.branches], 1)           # N, 2, C, H, W
        z = self.reduce(feats.sum(1).mean((2, 3)))
        a = self.select(z).view(x.shape[0], 2, -1).softmax(1)[..., None, None]
        return (feats * a).sum(1)


class _SKBlock(nn.Module):
    def __init__(self, cin: int, c: int, stride: int):
        super().__init__()
        self.sk = _SK(cin)
        self.conv = nn.Conv2d(cin, c, 3, stride, 1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.short = (nn.Sequential(nn.Conv2d(cin, c, 1, stride, bias=False), nn.BatchNorm2d(c))
                      if stride != 1 or cin != c else nn.Identity())

    def forward(self, x):
        return F.relu(self.bn(self.conv(self.sk(x))) + self.short(x))


class _SKResNet(nn.Module):
    """SK-ResNet-18-like: a ResNet-18 layout whose basic blocks start with a selective-kernel conv."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for c, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [_SKBlock(cin, c, stride), _SKBlock(c, c, 1)]
            cin = c
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


def sk_resnet18():
    torch.manual_seed(0)
    model = _SKResNet()
    x, y = torch.randn(2, 3, 128, 128), torch.tensor([1, 2])
    return model, lambda: F.cross_entropy(model(x), y)


#: name -> builder
VISION = {
    "resnet50-d (HF ResNet)": resnet50_d,
    "swin-t (HF Swin)": swin_t,
    "efficientnet-b0 (HF)": efficientnet_b0,
    "regnety-3.2gf-like (HF RegNet)": regnet_y,
    "convnext-t (HF ConvNext)": convnext_t,
    "sk-resnet-18-like (by hand)": sk_resnet18,
}
