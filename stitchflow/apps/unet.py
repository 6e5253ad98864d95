"""A diffusion-style U-Net (DDPM / Stable Diffusion's shape, without attention) in inference mode.

Residual blocks of GroupNorm → SiLU → 3x3 convolution twice with a 1x1 skip where the width
changes; stride-2 convolutions down, nearest 2x upsampling and a convolution up, skip connections
concatenated. Between its convolutions everything is memory-bound: group norm's statistics and
their broadcast, SiLU, the residual add, the upsample and the concatenation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .common import make_generator

UNET_PRESETS: dict[str, dict] = {
    "small": dict(widths=(8, 16), image=16, batch=2, groups=4),
    "sd-like": dict(widths=(64, 128, 256), image=64, batch=8, groups=32),
}


def _conv(cin: int, cout: int, k: int, stride: int, gen: torch.Generator, dtype) -> nn.Conv2d:
    conv = nn.utils.skip_init(nn.Conv2d, cin, cout, k, stride, k // 2, dtype=dtype)  # no global RNG
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen) * math.sqrt(1.0 / (cin * k * k)))
        conv.bias.copy_(0.02 * torch.randn(cout, generator=gen))
    return conv


def _norm(c: int, groups: int, gen: torch.Generator, dtype) -> nn.GroupNorm:
    norm = nn.GroupNorm(min(groups, c), c, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(c, generator=gen))
        norm.bias.copy_(0.1 * torch.randn(c, generator=gen))
    return norm


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int, gen: torch.Generator, dtype):
        super().__init__()
        self.norm1, self.conv1 = _norm(cin, groups, gen, dtype), _conv(cin, cout, 3, 1, gen, dtype)
        self.norm2, self.conv2 = _norm(cout, groups, gen, dtype), _conv(cout, cout, 3, 1, gen, dtype)
        self.skip = None if cin == cout else _conv(cin, cout, 1, 1, gen, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return h + (x if self.skip is None else self.skip(x))


class UNet(nn.Module):
    def __init__(self, widths, groups: int, seed: int = 0, dtype=torch.float32, **_):
        super().__init__()
        gen = make_generator(seed)
        self.stem = _conv(3, widths[0], 3, 1, gen, dtype)
        self.down = nn.ModuleList()
        self.downsample = nn.ModuleList()
        for cin, cout in zip(widths, widths[1:]):
            self.down.append(ResBlock(cin, cin, groups, gen, dtype))
            self.downsample.append(_conv(cin, cout, 3, 2, gen, dtype))
        self.middle = ResBlock(widths[-1], widths[-1], groups, gen, dtype)
        self.upsample = nn.ModuleList()
        self.up = nn.ModuleList()
        for cin, cout in zip(widths[::-1], widths[::-1][1:]):
            self.upsample.append(_conv(cin, cout, 3, 1, gen, dtype))
            self.up.append(ResBlock(2 * cout, cout, groups, gen, dtype))
        self.out_norm, self.out = _norm(widths[0], groups, gen, dtype), _conv(widths[0], 3, 3, 1, gen, dtype)
        self.param_formats = {n: "dense" for n, _ in self.named_parameters()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, skips = self.stem(x), []
        for block, down in zip(self.down, self.downsample):
            h = block(h)
            skips.append(h)
            h = down(h)
        h = self.middle(h)
        for upsample, block in zip(self.upsample, self.up):
            h = upsample(F.interpolate(h, scale_factor=2, mode="nearest"))
            h = block(torch.cat([h, skips.pop()], 1))
        return self.out(F.silu(self.out_norm(h)))
