"""ResNets (He et al., 2016) in inference mode: the convolutional workload of the zoo.

Between its convolutions a ResNet is FusionStitching's diet: batch norm (an affine map in eval
mode), relu, the residual add, the stem's max pool and the final global average pool. Basic
blocks (ResNet-18/34) and bottlenecks (ResNet-50) as torchvision builds them; weights drawn
from one seeded generator, batch-norm statistics away from the identity so that they matter.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .common import make_generator

RESNET_PRESETS: dict[str, dict] = {
    "small": dict(block="basic", layers=(1, 1), widths=(8, 16), image=32, batch=2, classes=10),
    "resnet18": dict(block="basic", layers=(2, 2, 2, 2), widths=(64, 128, 256, 512), image=224, batch=32,
                     classes=1000),
    "resnet50": dict(block="bottleneck", layers=(3, 4, 6, 3), widths=(64, 128, 256, 512), image=224, batch=32,
                     classes=1000),
}


def _conv(cin: int, cout: int, k: int, stride: int, gen: torch.Generator, dtype) -> nn.Conv2d:
    conv = nn.utils.skip_init(nn.Conv2d, cin, cout, k, stride, k // 2, bias=False, dtype=dtype)  # no global RNG
    with torch.no_grad():  # He initialisation (fan out), as torchvision
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen) * math.sqrt(2.0 / (cout * k * k)))
    return conv


def _norm(c: int, gen: torch.Generator, dtype) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(c, dtype=dtype)
    with torch.no_grad():
        bn.weight.copy_(1 + 0.1 * torch.randn(c, generator=gen))
        bn.bias.copy_(0.1 * torch.randn(c, generator=gen))
        bn.running_mean.copy_(0.1 * torch.randn(c, generator=gen))
        bn.running_var.copy_(1 + 0.2 * torch.rand(c, generator=gen))
    return bn


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int, gen: torch.Generator, dtype):
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = _conv(cin, width, 3, stride, gen, dtype), _norm(width, gen, dtype)
        self.conv2, self.bn2 = _conv(width, cout, 3, 1, gen, dtype), _norm(cout, gen, dtype)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            _conv(cin, cout, 1, stride, gen, dtype), _norm(cout, gen, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int, gen: torch.Generator, dtype):
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = _conv(cin, width, 1, 1, gen, dtype), _norm(width, gen, dtype)
        self.conv2, self.bn2 = _conv(width, width, 3, stride, gen, dtype), _norm(width, gen, dtype)
        self.conv3, self.bn3 = _conv(width, cout, 1, 1, gen, dtype), _norm(cout, gen, dtype)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            _conv(cin, cout, 1, stride, gen, dtype), _norm(cout, gen, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, block: str, layers, widths, classes: int, seed: int = 0, dtype=torch.float32, **_):
        super().__init__()
        gen = make_generator(seed)
        kind = {"basic": BasicBlock, "bottleneck": Bottleneck}[block]
        self.stem = nn.Sequential(_conv(3, widths[0], 7, 2, gen, dtype), _norm(widths[0], gen, dtype), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        stages, cin = [], widths[0]
        for i, (n, width) in enumerate(zip(layers, widths)):
            for j in range(n):
                stages.append(kind(cin, width, 2 if i > 0 and j == 0 else 1, gen, dtype))
                cin = width * kind.expansion
        self.stages = nn.Sequential(*stages)
        self.fc = nn.utils.skip_init(nn.Linear, cin, classes, dtype=dtype)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(self.fc.weight.shape, generator=gen) / math.sqrt(cin))
            self.fc.bias.zero_()
        self.param_formats = {n: "dense" for n, _ in self.named_parameters()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))
