"""Convolution weights between NCHW and channels last, all of a training step's in one launch.

A training step's forward converts each convolution weight to channels last for cuDNN (the optimizer
updates the NCHW parameter in place between steps, so the copy is made again each step), and its
backward gets the weights' gradients from cuDNN channels last, which autograd copies one by one into
the parameters' NCHW layout. Through torch that is one strided-copy kernel per tensor, 2-10 µs each
for ResNet-18's 20 weights on an H100, most of it launch and tail. Here one Triton kernel walks every
tensor's tiles: a program finds its tensor among the launch's (a static branch per tensor, the
tensors passed as tuples) and moves one output channel's [channels, taps] tile, read and written
along contiguous runs.
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
def _weight_layout_copies(srcs, dsts, starts, channels, windows, N: tl.constexpr, BCS: tl.constexpr,
                          KPS: tl.constexpr, TO_LAST: tl.constexpr):
    pid = tl.program_id(0)
    for i in tl.static_range(N):
        if (pid >= starts[i]) & (pid < starts[i + 1]):
            # an output channel o of the NCHW weight [O, C, K] is one contiguous slab of C·K elements, and
            # of the channels-last one [O, K, C] too: a program moves a [BC, K] tile of it, read along the
            # taps and written along the channels or the other way round (Triton turns it around in
            # shared memory between the two)
            C, K = channels[i], windows[i]
            blocks = tl.cdiv(C, BCS[i])
            o, c0 = (pid - starts[i]) // blocks, ((pid - starts[i]) % blocks) * BCS[i]
            c = c0 + tl.arange(0, BCS[i])[:, None]
            k = tl.arange(0, KPS[i])[None, :]
            inside = (c < C) & (k < K)
            nchw, last = o * C * K + c * K + k, o * C * K + k * C + c
            if TO_LAST:
                tl.store(dsts[i] + last, tl.load(srcs[i] + nchw, mask=inside), mask=inside)
            else:
                tl.store(dsts[i] + nchw, tl.load(srcs[i] + last, mask=inside), mask=inside)


def _tile(w: torch.Tensor) -> tuple[int, int]:
    """(channels, taps) of a program's tile: every tap of the window, as many channels as fit TILE."""
    taps = triton.next_power_of_2(w[0, 0].numel())
    return max(1, min(triton.next_power_of_2(w.shape[1]), TILE // taps)), taps


def channels_last_copies(weights) -> tuple:
    """Each weight [O, C, *window] stored channels last (memory [O, *window, C]); a weight already
    so, or of another rank, as it is. Those of a GPU (or under Triton's interpreter) that are NCHW
    contiguous are copied in one launch, the rest through torch."""
    return _copies(weights, to_last=True)


def contiguous_copies(tensors) -> tuple:
    """The other way: each tensor [O, C, *window] that is stored channels last, copied NCHW contiguous
    (one launch for those of a GPU or under the interpreter whose window fits a tile, through torch
    otherwise); any other as it is."""
    return _copies(tensors, to_last=False)


def _copies(tensors, to_last: bool) -> tuple:
    out = list(tensors)
    batches: dict = {}  # device -> positions of the tensors one launch there copies
    for k, w in enumerate(tensors):
        form = channels_last_format(w)
        if form is None:
            continue
        have, want = (torch.contiguous_format, form) if to_last else (form, torch.contiguous_format)
        if w.is_contiguous(memory_format=want):
            continue  # already so (a 1x1 weight is both)
        fits = w.numel() > 0 and w[0, 0].numel() <= TILE  # a program's tile holds an output channel's plane
        if w.is_contiguous(memory_format=have) and fits and (w.is_cuda or interpreting()):
            batches.setdefault(w.device, []).append(k)
        elif to_last or w.is_contiguous(memory_format=have):  # through torch (a strided weight goes channels last)
            out[k] = w.contiguous(memory_format=want)
    for batch in batches.values():
        for first in range(0, len(batch), MOST):
            chunk = batch[first:first + MOST]
            for k, copy in zip(chunk, _launch([tensors[k] for k in chunk], to_last)):
                out[k] = copy
    return tuple(out)


def _arguments(weights, copies, starts, to_last: bool) -> tuple[dict, dict]:
    """(the kernel's tensor and integer arguments, its constexpr ones) for one launch."""
    tiles = [_tile(w) for w in weights]
    values = dict(srcs=tuple(weights), dsts=tuple(copies), starts=tuple(starts),
                  channels=tuple(w.shape[1] for w in weights), windows=tuple(w[0, 0].numel() for w in weights))
    return values, {"N": len(weights), "BCS": tuple(c for c, _ in tiles), "KPS": tuple(k for _, k in tiles),
                    "TO_LAST": to_last}


def _launch(weights: list, to_last: bool) -> list:
    copies = [torch.empty_like(w, memory_format=channels_last_format(w) if to_last else torch.contiguous_format)
              for w in weights]
    starts = [0]
    for w in weights:
        starts.append(starts[-1] + w.shape[0] * triton.cdiv(w.shape[1], _tile(w)[0]))
    values, meta = _arguments(weights, copies, starts, to_last)
    with torch.cuda.device(weights[0].device) if weights[0].is_cuda else contextlib.nullcontext():
        _weight_layout_copies[(starts[-1],)](**values, **meta, num_warps=4)
    return copies


def compile_for_sm90(shapes: list, to_last: bool = True) -> dict:
    """Compile one launch for bfloat16 weights of `shapes` for sm_90 with Triton's ptxas (no GPU needed):
    its tile shapes and shared memory. Tests use it on CPU machines, where the interpreter takes any Python."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    ws = [torch.empty(tuple(s), dtype=torch.bfloat16) for s in shapes]
    starts = range(0, 8 * len(ws) + 1, 8)  # no 1 among them: Triton folds an int of 1 into the kernel
    values, meta = _arguments(ws, ws, starts, to_last)
    signature = {name: mangle_type(v) for name, v in values.items()} | dict.fromkeys(meta, "constexpr")
    kernel = triton.compile(ASTSource(_weight_layout_copies, signature, meta), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4})
    return {"tiles": [_tile(w) for w in ws], "shared": kernel.metadata.shared,
            "turned_in_shared": "st.shared" in kernel.asm["ptx"]}
