"""Convolution weights stored channels last, all of a training step's in one launch.

A training step's forward converts each convolution weight to channels last for cuDNN (the optimizer
updates the NCHW parameter in place between steps, so the copy is made again each step). Through
torch that is one strided-copy kernel per weight, 2-10 µs each for ResNet-18's 20 weights on an H100,
most of it launch and tail. Here one Triton kernel walks every weight's tiles: a program finds its
weight among the launch's (a static branch per weight, the tensors passed as tuples) and moves one
output channel's [channels, taps] tile, read and written along contiguous runs.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .conv import channels_last_format
from .runtime import interpreting

TILE = 1024  # elements a program moves (at most): [channels, window taps] of one output channel
MOST = 64  # weights per launch: each is a branch of the kernel


@triton.jit
def _channels_last_copies(srcs, dsts, starts, channels, windows, N: tl.constexpr, BCS: tl.constexpr,
                          KPS: tl.constexpr):
    pid = tl.program_id(0)
    for i in tl.static_range(N):
        if (pid >= starts[i]) & (pid < starts[i + 1]):
            # an output channel o of the NCHW weight [O, C, K] is one contiguous slab of C·K elements, and
            # of the copy [O, K, C] too: a program moves a [BC, K] tile of it, read along the taps and
            # written along the channels (Triton turns it around in shared memory between the two)
            C, K = channels[i], windows[i]
            blocks = tl.cdiv(C, BCS[i])
            o, c0 = (pid - starts[i]) // blocks, ((pid - starts[i]) % blocks) * BCS[i]
            c = c0 + tl.arange(0, BCS[i])[:, None]
            k = tl.arange(0, KPS[i])[None, :]
            inside = (c < C) & (k < K)
            tile = tl.load(srcs[i] + o * C * K + c * K + k, mask=inside)
            tl.store(dsts[i] + o * C * K + k * C + c, tile, mask=inside)


def _tile(w: torch.Tensor) -> tuple[int, int]:
    """(channels, taps) of a program's tile: every tap of the window, as many channels as fit TILE."""
    taps = triton.next_power_of_2(w[0, 0].numel())
    return max(1, min(triton.next_power_of_2(w.shape[1]), TILE // taps)), taps


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


def _arguments(weights, copies, starts) -> tuple[dict, dict]:
    """(the kernel's tensor and integer arguments, its constexpr ones) for one launch."""
    tiles = [_tile(w) for w in weights]
    values = dict(srcs=tuple(weights), dsts=tuple(copies), starts=tuple(starts),
                  channels=tuple(w.shape[1] for w in weights), windows=tuple(w[0, 0].numel() for w in weights))
    return values, {"N": len(weights), "BCS": tuple(c for c, _ in tiles), "KPS": tuple(k for _, k in tiles)}


def _launch(weights: list) -> list:
    copies = [torch.empty_like(w, memory_format=channels_last_format(w)) for w in weights]
    starts = [0]
    for w in weights:
        starts.append(starts[-1] + w.shape[0] * triton.cdiv(w.shape[1], _tile(w)[0]))
    values, meta = _arguments(weights, copies, starts)
    with torch.cuda.device(weights[0].device) if weights[0].is_cuda else contextlib.nullcontext():
        _channels_last_copies[(starts[-1],)](**values, **meta, num_warps=4)
    return copies


def compile_for_sm90(shapes: list) -> dict:
    """Compile one launch for bfloat16 weights of `shapes` for sm_90 with Triton's ptxas (no GPU needed):
    its tile shapes and shared memory. Tests use it on CPU machines, where the interpreter takes any Python."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    ws = [torch.empty(tuple(s), dtype=torch.bfloat16) for s in shapes]
    starts = range(0, 8 * len(ws) + 1, 8)  # no 1 among them: Triton folds an int of 1 into the kernel
    values, meta = _arguments(ws, ws, starts)
    signature = {name: mangle_type(v) for name, v in values.items()} | dict.fromkeys(meta, "constexpr")
    kernel = triton.compile(ASTSource(_channels_last_copies, signature, meta), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4})
    return {"tiles": [_tile(w) for w in ws], "shared": kernel.metadata.shared,
            "turned_in_shared": "st.shared" in kernel.asm["ptx"]}
