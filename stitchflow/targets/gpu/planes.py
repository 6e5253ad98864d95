"""An activation from NCHW to channels last in one transposing launch.

A training step's backward hands cuDNN's weight gradient the activations its forward saved, in the
gradient's layout (backend_layouts.like_gradient): U-Net's forward saves its group norms' SiLU outputs
NCHW (its group-norm kernels write them fastest so), and its backward copies each to channels last.
torch's strided copy moved those 4 MB tensors at about 0.7 TB/s on an H100 (11-12 µs each, ten a
step). Here a program moves a [channels, positions] tile of one image, read along the positions and
written along the channels (Triton turns it around in shared memory); the sizes are plain integer
arguments, which Triton specializes by their divisibility, so the loads and stores are vectors where
the channels and the positions come in multiples of 16.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .conv import channels_last_format
from .runtime import interpreting

TILE = (64, 64)  # [channels, positions] a program moves


@triton.jit
def _plane_copy(src, dst, C, K, BC: tl.constexpr, BK: tl.constexpr):
    n, cb, kb = tl.program_id(2), tl.program_id(1), tl.program_id(0)
    c = cb * BC + tl.arange(0, BC)[:, None]
    k = kb * BK + tl.arange(0, BK)[None, :]
    inside = (c < C) & (k < K)
    base = n.to(tl.int64) * C * K  # an image's slab is contiguous in both layouts
    tl.store(dst + base + k * C + c, tl.load(src + base + c * K + k, mask=inside), mask=inside)


def to_channels_last(x: torch.Tensor) -> torch.Tensor:
    """`x` [N, C, *spatial], NCHW contiguous, copied channels last (on a GPU or under Triton's
    interpreter; through torch otherwise, and for what is not NCHW contiguous)."""
    form = channels_last_format(x)
    if form is None or x.is_contiguous(memory_format=form):
        return x
    if not (x.is_contiguous() and x.numel() > 0 and (x.is_cuda or interpreting())):
        return x.contiguous(memory_format=form)
    out = torch.empty_like(x, memory_format=form)
    N, C, K = x.shape[0], x.shape[1], x[0, 0].numel()
    BC, BK = min(TILE[0], triton.next_power_of_2(C)), min(TILE[1], triton.next_power_of_2(K))
    grid = (triton.cdiv(K, BK), triton.cdiv(C, BC), N)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _plane_copy[grid](x, out, C, K, BC=BC, BK=BK, num_warps=4)
    return out
