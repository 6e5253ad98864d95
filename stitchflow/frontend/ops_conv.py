"""Lowerings of padding and convolution.

Padding is a select over index ranges: a constant outside the input, or a read of its edge
(replicate), its mirror image (reflect) or its other end (circular). A read that falls outside
the input appears only in a `where` branch that is not taken, as the IR allows.

A convolution is a contraction whose input reads are affine in an output and a window
coordinate (x[n, c, s·h + d·i]); zero padding is a pad node before it, so the contraction stays
a product of two reads (the targets run it as one: the gpu target as cuDNN's convolution of the
padded tensor). Groups add a group axis to the output, merged into the channels by a view.
A transposed convolution is a convolution of the input spread apart (zeros between its points)
with the flipped kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ir.errors import ShapeError, UnsupportedOpError
from ..ir.expr import Const, IndexValue, call
from . import values as V
from .ops_elementwise import elementwise
from .registry import LowerCtx, lowering
from .values import TensorValue

PAD_MODES = ("constant", "reflect", "replicate", "circular")


def _tuple(v, n: int) -> tuple:
    """An int or a sequence of one or n ints, as n ints (torch repeats a single value)."""
    v = tuple(v) if isinstance(v, (list, tuple)) else (v,)
    return v * n if len(v) == 1 else v


# ---------------------------------------------------------------- padding

def pad(ctx: LowerCtx, x: TensorValue, pads: list[tuple[int, int]], mode: str = "constant", value: float = 0.0,
        hint: str | None = None) -> TensorValue:
    """x padded by (before, after) per trailing dimension, `pads[0]` for the first of them;
    negative amounts crop."""
    if mode not in PAD_MODES:
        raise UnsupportedOpError("pad", f"mode {mode!r} (lowered: {', '.join(PAD_MODES)})", ctx.hint)
    lead = x.rank - len(pads)
    if lead < 0:
        raise ShapeError(f"pad: {len(pads)} padded dimensions for a rank-{x.rank} tensor")
    shape = list(x.shape[:lead]) + [n + lo + hi for n, (lo, hi) in zip(x.shape[lead:], pads)]
    if any(n < 0 for n in shape):
        raise ShapeError(f"pad: {pads} leaves a negative size of {tuple(x.shape)}")
    for n, (lo, hi) in zip(x.shape[lead:], pads):
        limit = n + min(lo, 0) + min(hi, 0) if mode == "circular" else n - 1
        if mode in ("reflect", "circular") and max(lo, hi) > limit:
            raise ShapeError(f"pad: {mode} padding {max(lo, hi)} is too large for a dimension of size {n}")
        if mode != "constant" and n == 0 and (lo > 0 or hi > 0):
            raise ShapeError(f"pad: {mode} padding of an empty dimension")

    def body(o, r, rg):
        def over(dim: int, index: list):
            if dim == x.rank:
                return x.read(index, rg)
            if dim < lead:
                return over(dim + 1, index + [o[dim]])
            n, (lo, hi) = x.shape[dim], pads[dim - lead]
            inside = V.add(o[dim], -lo)
            if mode == "circular":  # torch crops first, then wraps around what is left
                first, kept = max(-lo, 0), n - max(-lo, 0) - max(-hi, 0)
                wrapped = V.mod(V.add(o[dim], kept - max(lo, 0)), kept, rg)
                return over(dim + 1, index + [V.add(wrapped, first)])
            if mode == "constant":  # the condition is taken once, over every dimension, below
                return over(dim + 1, index + [inside])
            before, after = (V.Lit(0), V.Lit(n - 1)) if mode == "replicate" else (
                V.add(V.scale(o[dim], -1), lo), V.add(V.scale(o[dim], -1), 2 * n - 2 + lo))
            expr = over(dim + 1, index + [inside])
            if hi > 0:
                expr = call("where", call("ge", IndexValue(o[dim]), Const(lo + n)), over(dim + 1, index + [after]), expr)
            if lo > 0:
                expr = call("where", call("lt", IndexValue(o[dim]), Const(lo)), over(dim + 1, index + [before]), expr)
            return expr

        expr = over(0, [])
        if mode == "constant":
            conds = []
            for dim in range(lead, x.rank):
                n, (lo, hi) = x.shape[dim], pads[dim - lead]
                if lo > 0:
                    conds.append(call("ge", IndexValue(o[dim]), Const(lo)))
                if hi > 0:
                    conds.append(call("lt", IndexValue(o[dim]), Const(lo + n)))
            if conds:
                cond = conds[0]
                for c in conds[1:]:
                    cond = call("and", cond, c)
                expr = call("where", cond, expr, Const(value))
        return expr

    return ctx.builder.emit(shape, x.dtype, body, hint=hint or ctx.hint)


def _pairs(amounts, rank: int, what: str) -> list[tuple[int, int]]:
    """torch's pad list (last dimension first, before then after) as pairs, first padded dim first."""
    amounts = [int(a) for a in amounts]
    if len(amounts) % 2 or len(amounts) // 2 > rank:
        raise ShapeError(f"{what}: a pad list of {len(amounts)} values for a rank-{rank} tensor")
    pairs = [(amounts[i], amounts[i + 1]) for i in range(0, len(amounts), 2)]
    return pairs[::-1]


@lowering(F.pad, torch._C._nn.pad, "aten.pad")
def lower_pad(ctx, x, pad_amounts, mode="constant", value=None):
    return pad(ctx, x, _pairs(pad_amounts, x.rank, "pad"), mode, 0.0 if value is None else float(value))


@lowering(torch.constant_pad_nd, "aten.constant_pad_nd")
def lower_constant_pad_nd(ctx, x, pad_amounts, value=0):
    return pad(ctx, x, _pairs(pad_amounts, x.rank, "constant_pad_nd"), "constant", float(value))


def _aten_pad(mode: str):
    def lower(ctx, x, padding):
        return pad(ctx, x, _pairs(padding, x.rank, f"{mode}_pad"), mode)

    return lower


for _n in (1, 2, 3):
    lowering(f"aten.reflection_pad{_n}d")(_aten_pad("reflect"))
    lowering(f"aten.replication_pad{_n}d")(_aten_pad("replicate"))


# ---------------------------------------------------------------- convolution

def _same_padding(kernel, dilation, stride) -> list[tuple[int, int]]:
    if any(s != 1 for s in stride):
        raise ShapeError("conv: padding='same' needs stride 1 (as torch)")
    pairs = []
    for k, d in zip(kernel, dilation):
        total = d * (k - 1)
        pairs.append((total // 2, total - total // 2))  # torch puts the odd one after
    return pairs


def convolution(ctx: LowerCtx, x: TensorValue, weight: TensorValue, bias, stride, padding, dilation,
                groups: int, tag=None) -> TensorValue:
    n = weight.rank - 2
    if n < 1:
        raise ShapeError(f"conv: a weight of rank {weight.rank}")
    unbatched = x.rank == n + 1
    if unbatched:
        x = V.unsqueeze(x, 0)
    if x.rank != n + 2:
        raise ShapeError(f"conv{n}d: input of rank {x.rank - unbatched} for a rank-{weight.rank} weight")
    cout, cg, kernel = weight.shape[0], weight.shape[1], weight.shape[2:]
    if groups < 1 or cout % groups or x.shape[1] != cg * groups:
        raise ShapeError(f"conv{n}d: {x.shape[1]} input channels, weight {tuple(weight.shape)}, groups {groups}")
    stride, dilation = _tuple(stride, n), _tuple(dilation, n)
    if isinstance(padding, str):
        if padding not in ("same", "valid"):
            raise ShapeError(f"conv{n}d: padding {padding!r}")
        pads = _same_padding(kernel, dilation, stride) if padding == "same" else [(0, 0)] * n
    else:
        pads = [(p, p) for p in _tuple(padding, n)]
    if any(lo or hi for lo, hi in pads):
        x = pad(ctx, x, pads, "constant", 0.0, hint=f"{ctx.hint}_pad")
    out_size = [(size - d * (k - 1) - 1) // s + 1 for size, k, s, d in zip(x.shape[2:], kernel, stride, dilation)]
    if any(size <= 0 for size in out_size):
        raise ShapeError(f"conv{n}d: kernel {tuple(kernel)} (dilation {dilation}) larger than the padded input")
    batch, og = x.shape[0], cout // groups

    def body(o, r, rg):
        grouped = groups > 1
        g, oc = (o[1], o[2]) if grouped else (V.Lit(0), o[1])
        spatial = o[2 + grouped:]
        x_index = [o[0], V.add(V.scale(g, cg), r[0])] + [
            V.add(V.scale(h, s), V.scale(i, d)) for h, i, s, d in zip(spatial, r[1:], stride, dilation)]
        w_index = [V.add(V.scale(g, og), oc), r[0]] + list(r[1:])
        return call("mul", x.read(x_index, rg), weight.read(w_index, rg))

    tag = tag or ctx.builder.new_tag("conv")
    groups_axes = [groups, og] if groups > 1 else [cout]
    y = ctx.builder.emit([batch] + groups_axes + out_size, ctx.dtype, body, reduce="sum", red_shape=[cg, *kernel],
                         tag=tag, hint=ctx.hint)
    if groups > 1:
        y = V.reshape(y, [batch, cout] + out_size)
    if unbatched:
        y = V.select(y, 0, 0)
    if bias is None:
        return y
    b = V.reshape(bias, [cout] + [1] * n)
    return elementwise(ctx, lambda p, q: call("add", p, q), y, b, tag=tag, hint=f"{ctx.hint}_bias")


@lowering(F.conv1d, F.conv2d, F.conv3d, "aten.conv1d", "aten.conv2d", "aten.conv3d")
def lower_conv(ctx, x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return convolution(ctx, x, weight, bias, stride, padding, dilation, groups)


@lowering("aten.convolution", "aten._convolution")
def lower_aten_convolution(ctx, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups,
                           *rest):
    if transposed:
        return transposed_convolution(ctx, x, weight, bias, stride, padding, output_padding, groups, dilation)
    return convolution(ctx, x, weight, bias, stride, padding, dilation, groups)


# ---------------------------------------------------------------- transposed convolution

def transposed_convolution(ctx: LowerCtx, x: TensorValue, weight: TensorValue, bias, stride, padding,
                           output_padding, groups: int, dilation) -> TensorValue:
    """A plain convolution (stride 1) of the input spread `stride` apart and padded, with the kernel
    flipped and its channel axes swapped: the input point j lands at s·j + d·(k-1) - p."""
    n = weight.rank - 2
    if n < 1 or x.rank not in (n + 1, n + 2):
        raise ShapeError(f"conv_transpose: input of rank {x.rank} for a rank-{weight.rank} weight")
    stride, padding, output_padding, dilation = (_tuple(v, n) for v in (stride, padding, output_padding, dilation))
    cin, og, kernel = weight.shape[0], weight.shape[1], weight.shape[2:]
    if groups < 1 or cin % groups or x.shape[-n - 1] != cin:
        raise ShapeError(f"conv_transpose{n}d: {x.shape[-n - 1]} input channels, weight {tuple(weight.shape)}, "
                         f"groups {groups}")
    cg, lead = cin // groups, x.rank - n
    spread = [(size - 1) * s + 1 for size, s in zip(x.shape[lead:], stride)]
    before = [d * (k - 1) - p for k, p, d in zip(kernel, padding, dilation)]
    after = [b + op for b, op in zip(before, output_padding)]
    shape = list(x.shape[:lead]) + [m + b + a for m, b, a in zip(spread, before, after)]
    if any(size <= 0 for size in shape):
        raise ShapeError(f"conv_transpose{n}d: padding {padding} leaves no output")

    def spread_body(o, r, rg):
        index, conds = list(o[:lead]), []
        for axis, (s, b, size) in enumerate(zip(stride, before, x.shape[lead:])):
            shift = max(b, 0) // s + 1  # j - b + s·shift is never negative, so // and % mean what they say
            j = V.add(o[lead + axis], s * shift - b)
            index.append(V.add(V.floordiv(j, s, rg), -shift))
            if s > 1:
                conds.append(call("eq", IndexValue(V.mod(j, s, rg)), Const(0)))
            conds.append(call("ge", IndexValue(o[lead + axis]), Const(b)))
            conds.append(call("le", IndexValue(o[lead + axis]), Const(b + (size - 1) * s)))
        cond = conds[0]
        for c in conds[1:]:
            cond = call("and", cond, c)
        return call("where", cond, x.read(index, rg), Const(0.0))

    tag = ctx.builder.new_tag("conv_transpose")  # the gpu target finds the three nodes by it (conv.fold_spread)
    spread_x = ctx.builder.emit(shape, x.dtype, spread_body, tag=tag, hint=f"{ctx.hint}_spread")

    def flip_body(o, r, rg):  # w'[g·og + o, c, i] = w[g·cg + c, o, k - 1 - i]
        group, within = V.floordiv(o[0], og, rg), V.mod(o[0], og, rg)
        flipped = [V.add(V.scale(i, -1), k - 1) for i, k in zip(o[2:], kernel)]
        return weight.read([V.add(V.scale(group, cg), o[1]), within, *flipped], rg)

    flipped = ctx.builder.emit([og * groups, cg, *kernel], weight.dtype, flip_body, tag=tag, hint=f"{ctx.hint}_weight")
    return convolution(ctx, spread_x, flipped, bias, 1, 0, dilation, groups, tag=tag)


def _transposed(n: int):
    def lower(ctx, x, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
        return transposed_convolution(ctx, x, weight, bias, stride, padding, output_padding, groups, dilation)

    return lower


lowering(F.conv_transpose1d, "aten.conv_transpose1d")(_transposed(1))
lowering(F.conv_transpose2d, "aten.conv_transpose2d")(_transposed(2))
lowering(F.conv_transpose3d, "aten.conv_transpose3d")(_transposed(3))
