"""Scans along a dim (cumsum, cumprod, cummax, cummin, logcumsumexp): output i is a reduction over the
positions j <= i, whose terms past i are the reduction's neutral element. n² work, so dims of up to
MAX_SCAN elements (masks, positions, a sequence's running statistics), and a scan stitches like any
other reduction instead of being a new kind of node."""

from __future__ import annotations

import math

import torch

from ..ir.errors import UnsupportedOpError
from ..ir.expr import Cast, Const, IndexValue, call
from . import values as V
from .ops_reduce import reduce
from .registry import LOW_PRECISION, LowerCtx, compute_dtype, lowering, upcast
from .values import TensorValue

MAX_SCAN = 4096  # a prefix sum is a sum over j <= i here: n² work, fine for masks and positions, not for long rows


@lowering(torch.cumsum, "method:cumsum", "aten.cumsum")
def lower_cumsum(ctx, x, dim, *, dtype=None):
    """out[..., i, ...] = sum over j <= i of x[..., j, ...] (booleans and integers sum as int64)."""
    return _prefix(ctx, x, dim, "sum", Const(0), "cumsum")


@lowering(torch.cumprod, "method:cumprod", "aten.cumprod")
def lower_cumprod(ctx, x, dim, *, dtype=None):
    """out[..., i, ...] = product over j <= i of x[..., j, ...]."""
    return _prefix(ctx, x, dim, "prod", Const(1.0 if ctx.dtype.is_floating_point else 1), "cumprod")


def _prefix(ctx: LowerCtx, x: TensorValue, dim: int, kind: str, neutral: Const, what: str) -> TensorValue:
    """A `kind` reduction over j <= i whose terms past i are `neutral`; half precision accumulates in float32
    as eager does, other inputs in the result's dtype (dtype= may ask for another)."""
    if x.rank == 0:
        return reduce(ctx, x, [], kind, dtype=ctx.dtype)
    dim, n = _scanned(ctx, x, dim, what)

    def body(o, r, rg):
        read = x.read(_at(o, dim, r[0]), rg)
        if x.dtype in LOW_PRECISION and ctx.dtype == x.dtype:
            read = upcast(read, x)
        elif x.dtype != ctx.dtype:
            read = Cast(ctx.dtype, read)
        return call("where", _up_to(o, r, dim), read, neutral)

    return ctx.builder.emit(ctx.shape, ctx.dtype, body, reduce=kind, red_shape=[n], hint=ctx.hint)


def _scanned(ctx: LowerCtx, x: TensorValue, dim: int, what: str) -> tuple[int, int]:
    dim = V.norm_dim(dim, x.rank)
    n = x.shape[dim]
    if n > MAX_SCAN:
        raise UnsupportedOpError(what, f"a scan over {n} elements (at most {MAX_SCAN} are lowered)", ctx.hint)
    return dim, n


def _at(o, dim: int, position):
    return list(o[:dim]) + [position] + list(o[dim + 1:])


def _up_to(o, r, dim: int):
    return call("le", IndexValue(r[0]), IndexValue(o[dim]))


def _running_extreme(ctx: LowerCtx, x: TensorValue, dim: int, kind: str, what: str):
    """(values, int64 indices) of torch.cummax / cummin: the extreme so far (NaN once one is seen) and the
    last position holding it, as torch's `x >= best or isnan(x)` update leaves it."""
    if x.rank == 0:
        return x, ctx.builder.emit((), torch.int64, lambda o, r, rg: Const(0), hint=f"{ctx.hint}_index")
    dim, n = _scanned(ctx, x, dim, what)
    b, tag = ctx.builder, ctx.builder.new_tag(what)
    acc = compute_dtype(x.dtype)
    sign = (lambda e: e) if kind == "max" else (lambda e: call("neg", e))
    lowest = Const(-math.inf) if acc.is_floating_point else Const(torch.iinfo(acc).min)
    if not acc.is_floating_point and kind == "min":
        lowest = Const(-torch.iinfo(acc).max)  # the negated values' floor: -min would overflow

    def running(o, r, rg):
        return call("where", _up_to(o, r, dim), sign(upcast(x.read(_at(o, dim, r[0]), rg), x)), lowest)

    best = b.emit(x.shape, acc, running, reduce="max", red_shape=[n], tag=tag, hint=f"{ctx.hint}_best")
    values = b.emit(x.shape, x.dtype, lambda o, r, rg: sign(best.read(o, rg)), tag=tag, hint=ctx.hint)

    def last_holder(o, r, rg):
        v, here = values.read(o, rg), upcast(x.read(_at(o, dim, r[0]), rg), x)
        holds = call("or", call("eq", here, v), call("and", call("ne", here, here), call("ne", v, v)))
        return call("where", call("and", _up_to(o, r, dim), holds), Cast(torch.float32, IndexValue(r[0])), Const(-1.0))

    last = b.emit(x.shape, torch.float32, last_holder, reduce="max", red_shape=[n], tag=tag, hint=f"{ctx.hint}_last")
    indices = b.emit(x.shape, torch.int64, lambda o, r, rg: Cast(torch.int64, last.read(o, rg)), tag=tag,
                     hint=f"{ctx.hint}_index")
    return values, indices


@lowering(torch.cummax, "method:cummax", "aten.cummax")
def lower_cummax(ctx, x, dim, *, out=None):
    return _running_extreme(ctx, x, dim, "max", "cummax")


@lowering(torch.cummin, "method:cummin", "aten.cummin")
def lower_cummin(ctx, x, dim, *, out=None):
    return _running_extreme(ctx, x, dim, "min", "cummin")


@lowering(torch.logcumsumexp, "method:logcumsumexp", "aten.logcumsumexp")
def lower_logcumsumexp(ctx, x, dim, *, out=None):
    """log(sum_{j<=i} exp(x_j - m_i)) + m_i with m_i the running maximum (0 where it is infinite, so that
    all -inf gives -inf and an inf gives inf, as torch)."""
    if x.rank == 0:
        return x
    dim, n = _scanned(ctx, x, dim, "logcumsumexp")
    b, tag = ctx.builder, ctx.builder.new_tag("logcumsumexp")
    acc = compute_dtype(x.dtype)  # float32 for half precision, float64 kept

    def running_max(o, r, rg):
        return call("where", _up_to(o, r, dim), upcast(x.read(_at(o, dim, r[0]), rg), x), Const(-math.inf))

    peak = b.emit(x.shape, acc, running_max, reduce="max", red_shape=[n], tag=tag, hint=f"{ctx.hint}_max")
    shift = b.emit(x.shape, acc, lambda o, r, rg: call("where", call("eq", call("abs", peak.read(o, rg)),
                                                                              Const(math.inf)), Const(0.0), peak.read(o, rg)),
                   tag=tag, hint=f"{ctx.hint}_shift")

    def terms(o, r, rg):
        e = call("exp", call("sub", upcast(x.read(_at(o, dim, r[0]), rg), x), shift.read(o, rg)))
        return call("where", _up_to(o, r, dim), e, Const(0.0))

    total = b.emit(x.shape, acc, terms, reduce="sum", red_shape=[n], tag=tag, hint=f"{ctx.hint}_sum")
    return b.emit(x.shape, ctx.dtype, lambda o, r, rg: call("add", call("log", total.read(o, rg)), shift.read(o, rg)),
                  tag=tag, hint=ctx.hint)
