"""Lowerings of pooling whose windows tile the input (stride equal to the kernel, no padding, no
dilation; the default for a pooling layer given only its kernel size): each window is a pair of
axes of a reshaped view, and the pool is a mean or a max over them, which the stitching targets
fuse with the ops around it. Overlapping or padded windows are refused with the reason."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ir.errors import UnsupportedOpError
from . import values as V
from .ops_reduce import lower_amax, lower_mean
from .registry import LowerCtx, lowering


def _tuple(v, n: int) -> tuple:
    return tuple(v) if isinstance(v, (list, tuple)) else (v,) * n


def windows(ctx: LowerCtx, x: V.TensorValue, n: int, kernel, stride=None, padding=0, dilation=1, ceil_mode=False,
            what: str = "pool"):
    """x seen as [..., out_1, k_1, ..., out_n, k_n] over its last n axes, and the window axes."""
    kernel = _tuple(kernel, n)
    stride = kernel if stride is None or stride == [] or stride == () else _tuple(stride, n)
    if stride != kernel or any(_tuple(padding, n)) or any(d != 1 for d in _tuple(dilation, n)) or ceil_mode:
        raise UnsupportedOpError(what, f"kernel {kernel}, stride {stride}, padding {padding}, dilation {dilation}, "
                                 f"ceil_mode {ceil_mode}: only windows that tile the input are lowered", ctx.hint)
    lead = x.rank - n
    shape, view = list(x.shape[:lead]), x
    for axis, k in enumerate(kernel):
        whole = x.shape[lead + axis] // k * k  # floor mode drops the last partial window
        view = V.slice_dim(view, lead + axis, 0, whole, 1)
        shape += [whole // k, k]
    return V.reshape(view, shape), [lead + 2 * axis + 1 for axis in range(n)]


def _average(n: int):
    def lower(ctx, x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
              divisor_override=None):
        if divisor_override is not None:
            raise UnsupportedOpError(f"avg_pool{n}d", "divisor_override", ctx.hint)
        view, axes = windows(ctx, x, n, kernel_size, stride, padding, 1, ceil_mode, f"avg_pool{n}d")
        return lower_mean(ctx, view, axes)

    return lower


def _maximum(n: int):
    def lower(ctx, x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
        if return_indices:
            raise UnsupportedOpError(f"max_pool{n}d", "return_indices", ctx.hint)
        view, axes = windows(ctx, x, n, kernel_size, stride, padding, dilation, ceil_mode, f"max_pool{n}d")
        return lower_amax(ctx, view, axes)

    return lower


lowering(F.avg_pool2d, "aten.avg_pool2d")(_average(2))
lowering(F.avg_pool1d, "aten.avg_pool1d")(_average(1))
lowering(F.max_pool2d, torch.max_pool2d, "aten.max_pool2d")(_maximum(2))
lowering(F.max_pool1d, torch.max_pool1d, "aten.max_pool1d")(_maximum(1))
