"""Statistics over dims built from ops_reduce's reductions: variance and standard deviation (var, std,
var_mean, std_mean) with their squares kept in float32's range, the NaN-skipping sum and mean (nansum,
nanmean), aminmax, and histc as a scatter-add of ones. Half-precision inputs compute in float32, as eager's
kernels do."""

from __future__ import annotations

import torch

from ..ir.errors import UnsupportedOpError
from ..ir.expr import Cast, Const, call
from ..ir.index import Gather
from .ops_reduce import _correction_args, _dims, _widened, lower_amax, lower_amin, lower_sum, reduce, variance
from .ops_elementwise import elementwise
from .registry import compute_dtype, lowering, sub_ctx, upcast
from .values import TensorValue

# A float32 square overflows past 2^64 and leaves the normal numbers under 2^-63: eager's CPU kernels accumulate
# var and std of float32 in double (and its CUDA kernels give finite results there too), so a std of values near 1e30 (or a var of values near 1e19) is finite there.
# Rows whose largest magnitude is past LARGE are scaled by DOWN before the variance and back after it, rows
# under SMALL by UP: powers of two, so that the scaled statistics are exact and equal the unscaled ones wherever
# those neither overflow nor underflow (centred values of a scaled row stay within 2^49, squares within 2^98).
LARGE, DOWN = 2.0 ** 60, 2.0 ** -80
SMALL, UP = 2.0 ** -30, 2.0 ** 64


def _scale(peak, inverse: bool = False):
    """The power of two a row of largest magnitude `peak` is multiplied by (or its inverse); 1 for NaN."""
    down, up = (1 / DOWN, 1 / UP) if inverse else (DOWN, UP)
    return call("where", call("gt", peak, Const(LARGE)), Const(down),
                call("where", call("lt", peak, Const(SMALL)), Const(up), Const(1.0)))


def scaled_variance(ctx, x: TensorValue, dim, correction, tag, scaled: bool = True):
    """The mean, variance and standard deviation over `dim` as ops_reduce.variance takes them, in x's compute
    type; for float32 (and half) inputs, of x scaled per row by a power of two (LARGE, SMALL above) and scaled
    back, so that a variance or standard deviation float32 can hold comes out finite. Each is a function
    (o, rg) -> expression of a point `o` of the statistics (the reduced dims dropped)."""
    dims = _dims(dim, x.rank)
    acc = compute_dtype(x.dtype)
    b = ctx.builder
    if acc != torch.float32 or not scaled:  # float64 squares overflow past 1e154, as eager's do
        mean, _, var = variance(ctx, x, dims, correction, False, tag)
        return (lambda o, rg: mean.read(o, rg)), (lambda o, rg: var.read(o, rg)), (
            lambda o, rg: call("sqrt", var.read(o, rg)))
    peak = reduce(ctx, x, dims, "max", pre=lambda e, o: call("abs", e), dtype=acc, tag=tag, hint=f"{ctx.hint}_peak")

    def row(o):
        return [o[d] for d in range(len(o)) if d not in dims]

    xs = b.emit(x.shape, acc, lambda o, r, rg: call("mul", upcast(x.read(o, rg), x), _scale(peak.read(row(o), rg))),
                tag=tag, hint=f"{ctx.hint}_scaled")
    mean, _, var = variance(ctx, xs, dims, correction, False, tag)

    def unscaled(v, o, rg, times=1):
        e, back = v, _scale(peak.read(o, rg), inverse=True)
        for _ in range(times):  # (var * s) * s: s * s overflows float32 where var does not
            e = call("mul", e, back)
        return e

    return (lambda o, rg: unscaled(mean.read(o, rg), o, rg)), (lambda o, rg: unscaled(var.read(o, rg), o, rg, 2)), (
        lambda o, rg: unscaled(call("sqrt", var.read(o, rg)), o, rg))


def _statistic(ctx, dims, keepdim, shape, dtype, of, tag, hint):
    """A node of `shape` (the reduced dims kept as 1s when keepdim) holding of(row point, rg)."""
    def body(o, r, rg):
        return of([o[d] for d in range(len(o)) if d not in dims] if keepdim else list(o), rg)

    return ctx.builder.emit(shape, dtype, body, tag=tag, hint=hint)


def _spread(ctx, x, args, kwargs, what: str, with_mean: bool, scaled: bool = True):
    dim, correction, keepdim = _correction_args(args, kwargs)
    dims = _dims(dim, x.rank)
    tag = ctx.builder.new_tag(f"{what}_mean" if with_mean else what)
    mean, var, std = scaled_variance(ctx, x, dims, correction, tag, scaled)
    shape, dtype = (tuple(ctx.out[0].shape), ctx.out[0].dtype) if with_mean else (ctx.shape, ctx.dtype)
    spread = _statistic(ctx, dims, keepdim, shape, dtype, std if what == "std" else var, tag,
                        f"{ctx.hint}_spread" if with_mean else ctx.hint)
    if not with_mean:
        return spread
    return spread, _statistic(ctx, dims, keepdim, shape, ctx.out[1].dtype, mean, tag, f"{ctx.hint}_average")


lowering(torch.var, "method:var", "aten.var")(lambda ctx, x, *a, **k: _spread(ctx, x, a, k, "var", False))
lowering(torch.std, "method:std", "aten.std")(lambda ctx, x, *a, **k: _spread(ctx, x, a, k, "std", False))
lowering(torch.var_mean)(lambda ctx, x, *a, **k: _spread(ctx, x, a, k, "var", True))
# ATen's var_mean is what AOTAutograd's decompositions of batch norm (and group norm) in training emit: the peak's
# pass would cost every such statistic a reduction more, a pass and a barrier more where the channels' statistics
# are split across programs, for inputs past 1e19 that those norms' own CUDA kernels do not take either.
lowering("aten.var_mean")(lambda ctx, x, *a, **k: _spread(ctx, x, a, k, "var", True, scaled=False))
lowering(torch.std_mean, "aten.std_mean")(lambda ctx, x, *a, **k: _spread(ctx, x, a, k, "std", True))


# ---------------------------------------------------------------- NaN-skipping reductions

def _nan_to_zero(e):
    return call("where", call("ne", e, e), Const(0.0), e)


@lowering(torch.nansum, "method:nansum", "aten.nansum")
def lower_nansum(ctx, x, dim=None, keepdim=False, *, dtype=None):
    """The sum with NaN taken as 0 (integers and bools hold none: their sum)."""
    if not x.dtype.is_floating_point:
        return lower_sum(ctx, x, dim, keepdim, dtype=dtype)
    widened = _widened(ctx, x)
    return reduce(ctx, x, dim, "sum", keepdim=keepdim, dtype=ctx.dtype,
                  pre=lambda e, o: _nan_to_zero(widened(e, o) if widened else e))


@lowering(torch.nanmean, "method:nanmean", "aten.nanmean")
def lower_nanmean(ctx, x, dim=None, keepdim=False, *, dtype=None):
    """nansum / the count of numbers, as torch computes it (a row of NaN only gives 0 / 0, NaN); torch takes
    floating-point inputs only."""
    acc = compute_dtype(ctx.dtype)
    tag = ctx.builder.new_tag("nanmean")
    widen = (lambda e: e) if acc == compute_dtype(x.dtype) else (lambda e: Cast(acc, e))
    total = reduce(ctx, x, dim, "sum", keepdim=keepdim, dtype=acc, pre=lambda e, o: _nan_to_zero(widen(e)), tag=tag,
                   hint=f"{ctx.hint}_sum")
    count = reduce(ctx, x, dim, "sum", keepdim=keepdim, dtype=acc, tag=tag, hint=f"{ctx.hint}_count",
                   pre=lambda e, o: call("where", call("ne", e, e), Const(0.0), Const(1.0)))

    def body(o, r, rg):
        e = call("div", total.read(o, rg), count.read(o, rg))
        return e if acc == ctx.dtype else Cast(ctx.dtype, e)

    return ctx.builder.emit(ctx.shape, ctx.dtype, body, tag=tag, hint=ctx.hint)


# ---------------------------------------------------------------- aminmax

@lowering(torch.aminmax, "method:aminmax", "aten.aminmax")
def lower_aminmax(ctx, x, dim=None, keepdim=False):
    """(min, max) over `dim` (the whole tensor when None) as torch.return_types.aminmax, so that `.min` and
    `.max` read them; NaN propagates to both, as amin and amax."""
    if isinstance(dim, (list, tuple)):
        raise UnsupportedOpError("aminmax", f"dim={dim} (torch takes one dim)", ctx.hint)
    low, high = ctx.out
    dims = None if dim is None else [dim]
    lowest = lower_amin(sub_ctx(ctx, low.shape, low.dtype, "min"), x, dims, keepdim)
    highest = lower_amax(sub_ctx(ctx, high.shape, high.dtype, "max"), x, dims, keepdim)
    return torch.return_types.aminmax((lowest, highest))


@lowering(torch.histc, "method:histc", "aten.histc")
def lower_histc(ctx, x, bins=100, min=0, max=0, *, out=None):
    """Counts of x in `bins` equal bins over [min, max] (elements outside, NaN among them, not counted) as a
    scatter-add of ones: bin = floor((x - min) · bins / (max - min)) in x's dtype, as eager's kernels compute it
    (CUDA's in integer arithmetic for integer x), max itself in the last bin. min = max (eager then takes the
    data's own range) is refused."""
    from .ops_scatter import Writes, reduce_into

    if not isinstance(x, TensorValue):
        raise UnsupportedOpError("histc", "an input that is not a tensor", ctx.hint)
    if x.dtype in (torch.float16, torch.bfloat16) or x.dtype.is_complex or x.dtype == torch.bool:
        raise UnsupportedOpError("histc", f"{x.dtype} input (its counts round as eager's half-precision "
                                          "accumulation does)", ctx.hint)
    if min == max:
        raise UnsupportedOpError("histc", "min = max: the range is the data's own minimum and maximum", ctx.hint)
    bins, floating = int(bins), x.dtype.is_floating_point
    low, high = (float(torch.tensor(v, dtype=x.dtype)) if floating else int(v) for v in (min, max))
    width = float(torch.tensor(high, dtype=x.dtype) - torch.tensor(low, dtype=x.dtype)) if floating else high - low

    def bin_of(o, r, rg):
        v = x.read(o, rg)
        scaled = call("mul", call("sub", v, Const(low)), Const(bins))
        at = (Cast(torch.int64, call("floor", call("div", scaled, Const(width)))) if floating
              else call("floordiv", Cast(torch.int64, scaled), Const(width)))
        return call("where", call("ge", at, Const(bins)), Const(bins - 1), call("where", call("lt", at, Const(0)),
                                                                                 Const(0), at))

    bin_at = ctx.builder.emit(x.shape, torch.int64, bin_of, hint=f"{ctx.hint}_bin")
    def inside(v):
        return call("where", call("and", call("ge", v, Const(low)), call("le", v, Const(high))), Const(1), Const(0))

    counted = elementwise(sub_ctx(ctx, x.shape, ctx.dtype, "counted"), inside, x)
    zeros = ctx.builder.add_param("zeros", torch.zeros(bins, dtype=ctx.dtype))

    def out_index(o, rg):
        read = bin_at.access(o, rg)
        return [Gather(read.tensor, read.indices)]

    return reduce_into(ctx, zeros, Writes(tuple(x.shape), out_index, counted), "sum")
