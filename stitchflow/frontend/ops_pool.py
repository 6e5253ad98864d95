"""Lowerings of average and max pooling.

Windows that tile the input (stride equal to the kernel, no padding, no dilation: the default for
a pooling layer given only its kernel size) are pairs of axes of a reshaped view, and the pool a
mean or a max over them, which the stitching targets fuse with the ops around it. Other windows
(overlapping, padded, dilated, ceil mode) are a reduction over window coordinates read at
s·o + d·k - p, positions outside the input excluded by a `where` (-inf for a max, 0 for a sum),
and the average divided as torch divides it (count_include_pad, divisor_override). Adaptive
average pooling is a global mean, tiling windows, or (windows of uneven sizes) a weighted sum over
taps as interpolation's."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ir.errors import UnsupportedOpError
from ..ir.expr import Cast, Const, IndexValue, call
from . import values as V
from .ops_reduce import MAX_INDEXED, lower_amax, lower_mean
from .ops_resize import resize
from .registry import LowerCtx, lowering, upcast


def _tuple(v, n: int) -> tuple:
    """An int or a sequence of one or n ints, as n ints (torch repeats a single value)."""
    v = tuple(v) if isinstance(v, (list, tuple)) else (v,)
    return v * n if len(v) == 1 else v


def _window(n: int, kernel, stride, padding, dilation):
    kernel = _tuple(kernel, n)
    stride = kernel if stride is None or stride == [] or stride == () else _tuple(stride, n)
    return kernel, stride, _tuple(padding, n), _tuple(dilation, n)


def tiles(kernel, stride, padding, dilation, ceil_mode) -> bool:
    return stride == kernel and not any(padding) and all(d == 1 for d in dilation) and not ceil_mode


def windows(ctx: LowerCtx, x: V.TensorValue, n: int, kernel):
    """x seen as [..., out_1, k_1, ..., out_n, k_n] over its last n axes, and the window axes
    (windows that tile the input)."""
    lead = x.rank - n
    shape, view = list(x.shape[:lead]), x
    for axis, k in enumerate(kernel):
        whole = x.shape[lead + axis] // k * k  # floor mode drops the last partial window
        view = V.slice_dim(view, lead + axis, 0, whole, 1)
        shape += [whole // k, k]
    return V.reshape(view, shape), [lead + 2 * axis + 1 for axis in range(n)]


def _window_read(x: V.TensorValue, n: int, window, out, o, r, rg):
    """(the read of x at the window point, the condition that it lies inside x or None, its flat
    position h·W + w in its plane)."""
    kernel, stride, padding, dilation = window
    lead = x.rank - n
    index, conds, flat = list(o[:lead]), [], V.Lit(0)
    for axis, (k, s, p, d, size) in enumerate(zip(kernel, stride, padding, dilation, x.shape[lead:])):
        pos = V.add(V.scale(o[lead + axis], s), V.scale(r[axis], d), -p)
        index.append(pos)
        flat = V.add(V.scale(flat, size), pos)
        if p > 0:
            conds.append(call("ge", IndexValue(pos), Const(0)))
        if s * (out[axis] - 1) + d * (k - 1) - p >= size:  # ceil mode's last window runs past the end
            conds.append(call("lt", IndexValue(pos), Const(size)))
    inside = None
    for c in conds:
        inside = c if inside is None else call("and", inside, c)
    return upcast(x.read(index, rg), x), inside, flat


def sliding(ctx: LowerCtx, x: V.TensorValue, n: int, window, kind: str, fill: float, scale=None, shape=None):
    """out[..., o] = kind over the window k of x[..., s·o + d·k - p] (`fill` where that lies outside
    x), times `scale` (a constant, or a tensor over the output's last n axes). The output's size
    is eager's (ceil mode included)."""
    shape = tuple(shape or ctx.shape)
    if x.rank != len(shape):
        raise UnsupportedOpError(f"{kind} pool", f"input of rank {x.rank}, output of rank {len(shape)}", ctx.hint)

    def body(o, r, rg):
        e, inside, _ = _window_read(x, n, window, shape[-n:], o, r, rg)
        if inside is not None:
            e = call("where", inside, e, Const(fill))
        if isinstance(scale, V.TensorValue):
            return call("mul", e, scale.read(list(o[x.rank - n:]), rg))
        return call("mul", e, Const(scale)) if scale is not None else e

    return ctx.builder.emit(shape, x.dtype, body, reduce=kind, red_shape=list(window[0]), hint=ctx.hint)


def max_with_indices(ctx: LowerCtx, x: V.TensorValue, n: int, window):
    """(values, indices) of a max pool: the index of each window's first maximum (a NaN counts as
    one, as torch) as its flat position in the input plane, found as max_k where(x = peak, -position,
    -plane) in float32, the way max(dim) finds its index."""
    plane = math.prod(x.shape[x.rank - n:])
    if plane >= MAX_INDEXED:
        raise UnsupportedOpError(f"max_pool{n}d", f"{plane} positions per plane (indices are found in float32)",
                                 ctx.hint)
    shape = tuple(ctx.out[0].shape)
    peak = sliding(ctx, x, n, window, "max", -math.inf, shape=shape)

    def first_at_peak(o, r, rg):
        v, inside, flat = _window_read(x, n, window, shape[-n:], o, r, rg)
        m = upcast(peak.read(list(o), rg), peak)
        hit = call("or", call("eq", v, m), call("ne", v, v))
        hit = call("and", inside, hit) if inside is not None else hit
        return call("where", hit, call("neg", Cast(torch.float32, IndexValue(flat))), Const(float(-plane)))

    first = ctx.builder.emit(shape, torch.float32, first_at_peak, reduce="max", red_shape=list(window[0]),
                             hint=f"{ctx.hint}_first")
    index = ctx.builder.emit(shape, torch.int64, lambda o, r, rg: Cast(torch.int64, call("neg", first.read(o, rg))),
                             hint=f"{ctx.hint}_index")
    return peak, index


def _average_divisors(ctx, x, window, ceil_mode, count_include_pad, divisor_override):
    """1 / the divisor of each output position, as torch's avg_pool divides: a constant where every
    window divides alike."""
    kernel, stride, padding, _ = window
    n = len(kernel)
    if divisor_override is not None:
        return 1.0 / divisor_override
    per_axis = []
    for k, s, p, size, out in zip(kernel, stride, padding, x.shape[-n:], ctx.shape[-n:]):
        start = torch.arange(out) * s - p
        end = torch.minimum(start + k, torch.tensor(size + p))
        if not count_include_pad:
            start, end = start.clamp(min=0), end.clamp(max=size)
        per_axis.append((end - start).double())
    counts = per_axis[0]
    for c in per_axis[1:]:
        counts = counts[..., None] * c
    if bool((counts == counts.flatten()[0]).all()):
        return 1.0 / float(counts.flatten()[0])
    return ctx.builder.add_param("pool_divisor", (1.0 / counts).to(device=ctx.out.device, dtype=torch.float32))


def _average(n: int):
    def lower(ctx, x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
              divisor_override=None):
        window = _window(n, kernel_size, stride, padding, 1)
        if tiles(*window, ceil_mode) and divisor_override is None:
            view, axes = windows(ctx, x, n, window[0])
            return lower_mean(ctx, view, axes)
        scale = _average_divisors(ctx, x, window, ceil_mode, count_include_pad, divisor_override)
        return sliding(ctx, x, n, window, "sum", 0.0, scale)

    return lower


def _maximum(n: int):
    def lower(ctx, x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
        window = _window(n, kernel_size, stride, padding, dilation)
        if return_indices or isinstance(ctx.out, tuple):
            return max_with_indices(ctx, x, n, window)
        if tiles(*window, ceil_mode):
            view, axes = windows(ctx, x, n, window[0])
            return lower_amax(ctx, view, axes)
        return sliding(ctx, x, n, window, "max", -math.inf)

    return lower


lowering(F.avg_pool1d, torch.avg_pool1d, "aten.avg_pool1d")(_average(1))
lowering(F.avg_pool2d, "aten.avg_pool2d")(_average(2))
lowering(F.avg_pool3d, "aten.avg_pool3d")(_average(3))
lowering(F.max_pool1d, torch.max_pool1d, "aten.max_pool1d", F.max_pool1d_with_indices,
         "aten.max_pool1d_with_indices")(_maximum(1))
lowering(F.max_pool2d, torch.max_pool2d, "aten.max_pool2d", F.max_pool2d_with_indices,
         "aten.max_pool2d_with_indices")(_maximum(2))
lowering(F.max_pool3d, torch.max_pool3d, "aten.max_pool3d", F.max_pool3d_with_indices,
         "aten.max_pool3d_with_indices")(_maximum(3))


def _adaptive_average(n: int):
    def lower(ctx, x, output_size):
        out, size = ctx.shape[-n:], x.shape[-n:]
        dims = list(range(x.rank - n, x.rank))
        if all(o == 1 for o in out):
            return lower_mean(ctx, x, dims, keepdim=True)
        if all(s % o == 0 for s, o in zip(size, out)):  # windows of s // o that tile the input
            view, axes = windows(ctx, x, n, tuple(s // o for s, o in zip(size, out)))
            return lower_mean(ctx, view, axes)
        return resize(ctx, x, n, (output_size,), {})

    return lower


lowering(F.adaptive_avg_pool1d, torch.adaptive_avg_pool1d, "aten.adaptive_avg_pool1d")(_adaptive_average(1))
lowering(F.adaptive_avg_pool2d, "aten.adaptive_avg_pool2d", "aten._adaptive_avg_pool2d")(_adaptive_average(2))
lowering(F.adaptive_avg_pool3d, "aten.adaptive_avg_pool3d", "aten._adaptive_avg_pool3d")(_adaptive_average(3))


def _max_pool_backward(dims: int):
    def lower(ctx, grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
        """The gradient of a max pool, gathered rather than scattered (as eager's kernel does): each
        input position sums the gradients of the windows that could hold it, those whose argmax
        (`indices`, flat over the input's last `dims` dims) is that position. A window o covers
        position h when s·o - p <= h <= s·o - p + d·(k-1), so the candidates are the
        d·(k-1) // s + 1 windows ending at (h + p) // s, visited in ascending order; a candidate
        outside the pooled grid is masked out. No scatter: the sum is a small reduction that fuses
        with what reads the gradient, and nothing needs atomics or a zeroed buffer."""
        from .registry import compute_dtype

        kernel, stride_, pad, dil = _window(dims, kernel_size, stride, padding, dilation)
        lead, pooled, size = x.rank - dims, grad.shape[x.rank - dims:], x.shape[x.rank - dims:]
        counts = [d * (k - 1) // s + 1 for k, s, d in zip(kernel, stride_, dil)]
        acc = compute_dtype(ctx.dtype)

        def body(o, r, rg):
            window, flat, conds = list(o[:lead]), V.Lit(0), []
            for axis in range(dims):
                h = o[lead + axis]
                last = V.floordiv(V.add(h, pad[axis]), stride_[axis], rg)
                w = V.add(last, r[axis], 1 - counts[axis])  # ascending: the first window first
                window.append(w)
                flat = V.add(V.scale(flat, size[axis]), h)
                if counts[axis] > 1:
                    conds.append(call("ge", IndexValue(w), Const(0)))
                if (x.shape[lead + axis] - 1 + pad[axis]) // stride_[axis] >= pooled[axis]:
                    conds.append(call("lt", IndexValue(w), Const(pooled[axis])))
            hit = call("eq", indices.read(window, rg), IndexValue(flat))
            for c in conds:
                hit = call("and", c, hit)
            return call("where", hit, Cast(acc, grad.read(window, rg)), Const(0.0))

        summed = ctx.builder.emit(ctx.shape, acc, body, reduce="sum", red_shape=counts, hint=f"{ctx.hint}_gather")
        if acc == ctx.dtype:
            return summed
        return ctx.builder.emit(ctx.shape, ctx.dtype, lambda o, r, rg: Cast(ctx.dtype, summed.read(o, rg)),
                                hint=ctx.hint)
    return lower


lowering("aten.max_pool2d_with_indices_backward")(_max_pool_backward(2))
lowering("aten.max_pool3d_with_indices_backward")(_max_pool_backward(3))
