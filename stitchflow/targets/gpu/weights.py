"""Convolution weights stored channels last, all of a training step's in one launch.

A training step's forward converts each convolution weight to channels last for cuDNN (the optimizer
updates the NCHW parameter in place between steps, so the copy is made again each step). Through
torch that is one strided-copy kernel per weight, 2-10 µs each for ResNet-18's 20 weights on an H100,
most of it launch and tail. Here one Triton kernel walks every weight's blocks: a program finds its
weight among the launch's (a static branch per weight, the tensors passed as tuples) and writes a
contiguous block of the channels-last copy, gathering it from the NCHW weight.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .conv import channels_last_format
from .runtime import interpreting

BLOCK = 1024
MOST = 64  # weights per launch: each is a branch of the kernel


@triton.jit
def _channels_last_copies(srcs, dsts, starts, channels, windows, numels, N: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    for i in tl.static_range(N):
        if (pid >= starts[i]) & (pid < starts[i + 1]):
            # element o of the copy is w[o // (C·K), o % C, (o // C) % K] of the NCHW weight [O, C, K]
            o = (pid - starts[i]) * BLOCK + tl.arange(0, BLOCK)
            c, rest = o % channels[i], o // channels[i]
            src = (rest // windows[i]) * (channels[i] * windows[i]) + c * windows[i] + rest % windows[i]
            inside = o < numels[i]
            tl.store(dsts[i] + o, tl.load(srcs[i] + src, mask=inside), mask=inside)


def channels_last_copies(weights) -> tuple:
    """Each weight [O, C, *window] stored channels last (memory [O, *window, C]); a weight already
    so, or of another rank, as it is. Those of a GPU (or under Triton's interpreter) that are NCHW
    contiguous are copied in one launch, the rest through torch."""
    out = list(weights)
    batches: dict = {}  # device -> positions of the weights one launch there copies
    for k, w in enumerate(weights):
        form = channels_last_format(w)
        if form is None or w.is_contiguous(memory_format=form):
            continue
        if w.is_contiguous() and w.numel() > 0 and (w.is_cuda or interpreting()):
            batches.setdefault(w.device, []).append(k)
        else:
            out[k] = w.contiguous(memory_format=form)
    for batch in batches.values():
        for first in range(0, len(batch), MOST):
            chunk = batch[first:first + MOST]
            for k, copy in zip(chunk, _launch([weights[k] for k in chunk])):
                out[k] = copy
    return tuple(out)


def _launch(weights: list) -> list:
    copies = [torch.empty_like(w, memory_format=channels_last_format(w)) for w in weights]
    starts = [0]
    for w in weights:
        starts.append(starts[-1] + triton.cdiv(w.numel(), BLOCK))
    with torch.cuda.device(weights[0].device) if weights[0].is_cuda else contextlib.nullcontext():
        _channels_last_copies[(starts[-1],)](
            tuple(weights), tuple(copies), tuple(starts), tuple(w.shape[1] for w in weights),
            tuple(w[0, 0].numel() for w in weights), tuple(w.numel() for w in weights),
            N=len(weights), BLOCK=BLOCK, num_warps=4)
    return copies
