"""Scans along a dim (cumsum, cumprod, cummax, cummin, logcumsumexp). Output i is a reduction over the
positions j <= i of its window, whose terms past i are the reduction's neutral element, so a scan
stitches like any other reduction instead of being a new kind of node.

A short dim (up to QUADRATIC_SCAN) is one window: n² work, one node. A longer one is cut into blocks of
SCAN_BLOCK, as GPU scan libraries do: each element scans its own block up to itself (n·SCAN_BLOCK work),
each block's total is a reduction over the block, the totals are scanned the same way (recursively, so
any length goes), and element i combines the running total of the blocks before its own with its
block's prefix. Each scan says what an element's state is (a sum; a running maximum and where it was
last seen; a log-sum-exp), how a window reduces it and how an earlier state combines with a later one."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..ir.expr import Cast, Const, Expr, IndexValue, call
from ..ir.index import add, floordiv, mod, scale
from . import values as V
from .ops_reduce import reduce
from .registry import LOW_PRECISION, LowerCtx, compute_dtype, lowering, upcast
from .values import TensorValue

QUADRATIC_SCAN = 1024  # dims up to this long are scanned in one node (n² work)
SCAN_BLOCK = 64  # a longer dim's blocks: n·SCAN_BLOCK work a level, levels of n / SCAN_BLOCK^k totals

Term = Callable[[list, dict], tuple]  # (coordinates, ranges) -> the state of the element there, as expressions


@dataclass(frozen=True)
class _Window:
    """The positions a window reduction reads: its r-th at(o, r, rg), taken where keep(o, r, rg)."""

    block: int
    at: Callable
    keep: Callable


def _prefix_window(dim: int, block: int) -> _Window:
    """Element i's block from its start up to i (the whole dim up to i when the block is the dim)."""
    def at(o, r, rg):
        return _at(o, dim, add(o[dim], scale(mod(o[dim], block, rg), -1), r[0]))

    def keep(o, r, rg):
        return call("le", IndexValue(r[0]), IndexValue(mod(o[dim], block, rg)))

    return _Window(block, at, keep)


def _block_window(dim: int, block: int, n: int) -> _Window:
    """All of block o[dim] (the last one may hold fewer than `block` elements)."""
    def at(o, r, rg):
        return _at(o, dim, add(scale(o[dim], block), r[0]))

    def keep(o, r, rg):
        return call("lt", IndexValue(add(scale(o[dim], block), r[0])), Const(n))

    return _Window(block, at, keep)


@dataclass(frozen=True)
class _Scan:
    """window(ctx, term, shape, window, dtypes) -> one tensor per state part, each element's window reduced;
    combine(earlier, later) -> the state after both, as expressions; states: the parts' dtypes."""

    window: Callable
    combine: Callable
    states: tuple[torch.dtype, ...]


def _scan(ctx: LowerCtx, op: _Scan, term: Term, shape: list, dim: int, dtypes) -> tuple[TensorValue, ...]:
    """The inclusive scan of the elements' states along dim, as tensors of `dtypes` (the intermediates in
    op.states)."""
    n = shape[dim]
    block = n if n <= QUADRATIC_SCAN else SCAN_BLOCK
    local = op.window(ctx, term, shape, _prefix_window(dim, block), dtypes if block == n else op.states)
    if block == n:
        return local
    totals_shape = _at(shape, dim, -(-n // block))
    totals = op.window(ctx, term, totals_shape, _block_window(dim, block, n), op.states)
    carried = _scan(ctx, op, _reader(totals), totals_shape, dim, op.states)

    def part(k):
        def body(o, r, rg):
            mine = tuple(t.read(o, rg) for t in local)
            before = tuple(t.read(_at(o, dim, add(floordiv(o[dim], block, rg), -1)), rg) for t in carried)
            first_block = call("lt", IndexValue(o[dim]), Const(block))  # (its read of block -1 is clamped, unused)
            return call("where", first_block, mine[k], op.combine(before, mine)[k])
        return body

    return tuple(ctx.builder.emit(shape, dtype, part(k), hint=f"{ctx.hint}_carried") for k, dtype in enumerate(dtypes))


def _reader(tensors) -> Term:
    return lambda coords, rg: tuple(t.read(coords, rg) for t in tensors)


def _at(o, dim: int, position):
    return list(o[:dim]) + [position] + list(o[dim + 1:])


# ---------------------------------------------------------------- sums and products

def _folding(kind: str, neutral: Const, state: torch.dtype) -> _Scan:
    """A scan whose state is one number, reduced by `kind` (sum, prod)."""
    def window(ctx, term, shape, win, dtypes):
        def body(o, r, rg):
            return call("where", win.keep(o, r, rg), term(win.at(o, r, rg), rg)[0], neutral)
        return (ctx.builder.emit(shape, dtypes[0], body, reduce=kind, red_shape=[win.block], hint=ctx.hint),)

    combine = {"sum": "add", "prod": "mul"}[kind]
    return _Scan(window, lambda earlier, later: (call(combine, earlier[0], later[0]),), (state,))


@lowering(torch.cumsum, "method:cumsum", "aten.cumsum")
def lower_cumsum(ctx, x, dim, *, dtype=None):
    """out[..., i, ...] = sum over j <= i of x[..., j, ...] (booleans and integers sum as int64)."""
    return _prefix(ctx, x, dim, "sum", Const(0))


@lowering(torch.cumprod, "method:cumprod", "aten.cumprod")
def lower_cumprod(ctx, x, dim, *, dtype=None):
    """out[..., i, ...] = product over j <= i of x[..., j, ...]."""
    return _prefix(ctx, x, dim, "prod", Const(1.0 if ctx.dtype.is_floating_point else 1))


def _prefix(ctx: LowerCtx, x: TensorValue, dim: int, kind: str, neutral: Const) -> TensorValue:
    """A `kind` scan; half precision accumulates in float32 as eager does, other inputs in the result's
    dtype (dtype= may ask for another)."""
    if x.rank == 0:
        return reduce(ctx, x, [], kind, dtype=ctx.dtype)
    dim = V.norm_dim(dim, x.rank)

    def term(coords, rg):
        read = x.read(coords, rg)
        if x.dtype in LOW_PRECISION and ctx.dtype == x.dtype:
            return (upcast(read, x),)
        return (read if x.dtype == ctx.dtype else Cast(ctx.dtype, read),)

    op = _folding(kind, neutral, compute_dtype(ctx.dtype))
    return _scan(ctx, op, term, list(x.shape), dim, (ctx.dtype,))[0]


# ---------------------------------------------------------------- running extremes

def _extreme(lowest: Const, states: tuple) -> _Scan:
    """State (the largest value so far, the last position holding it, in float32); NaN is larger than all, and
    a later NaN or an equal value takes the position, as torch's `x >= best or isnan(x)` update."""
    def window(ctx, term, shape, win, dtypes):
        b, tag = ctx.builder, ctx.builder.new_tag("running_extreme")

        def running(o, r, rg):
            return call("where", win.keep(o, r, rg), term(win.at(o, r, rg), rg)[0], lowest)

        best = b.emit(shape, dtypes[0], running, reduce="max", red_shape=[win.block], tag=tag, hint=f"{ctx.hint}_best")

        def last_holder(o, r, rg):
            here, position = term(win.at(o, r, rg), rg)
            top = best.read(o, rg)
            holds = call("or", call("eq", here, top), call("and", call("ne", here, here), call("ne", top, top)))
            return call("where", call("and", win.keep(o, r, rg), holds), position, Const(-1.0))

        last = b.emit(shape, dtypes[1], last_holder, reduce="max", red_shape=[win.block], tag=tag,
                      hint=f"{ctx.hint}_last")
        return best, last

    def combine(earlier, later):
        takes = call("or", call("ge", later[0], earlier[0]), call("ne", later[0], later[0]))
        return tuple(call("where", takes, a, b) for a, b in zip(later, earlier))

    return _Scan(window, combine, states)


def _running_extreme(ctx: LowerCtx, x: TensorValue, dim: int, kind: str):
    """(values, int64 indices) of torch.cummax / cummin: a running maximum of the values (negated for cummin)."""
    if x.rank == 0:
        return x, ctx.builder.emit((), torch.int64, lambda o, r, rg: Const(0), hint=f"{ctx.hint}_index")
    dim = V.norm_dim(dim, x.rank)
    acc = compute_dtype(x.dtype)
    sign = (lambda e: e) if kind == "max" else (lambda e: call("neg", e))
    lowest = Const(-math.inf) if acc.is_floating_point else Const(torch.iinfo(acc).min)
    if not acc.is_floating_point and kind == "min":
        lowest = Const(-torch.iinfo(acc).max)  # the negated values' floor: -min would overflow

    def term(coords, rg):
        return sign(upcast(x.read(coords, rg), x)), Cast(torch.float32, IndexValue(coords[dim]))

    states = (acc, torch.float32)  # float32 positions: exact up to 2^24
    best, last = _scan(ctx, _extreme(lowest, states), term, list(x.shape), dim, states)
    b, tag = ctx.builder, ctx.builder.new_tag(kind)
    values = b.emit(x.shape, x.dtype, lambda o, r, rg: sign(best.read(o, rg)), tag=tag, hint=ctx.hint)
    indices = b.emit(x.shape, torch.int64, lambda o, r, rg: Cast(torch.int64, last.read(o, rg)), tag=tag,
                     hint=f"{ctx.hint}_index")
    return values, indices


@lowering(torch.cummax, "method:cummax", "aten.cummax")
def lower_cummax(ctx, x, dim, *, out=None):
    return _running_extreme(ctx, x, dim, "max")


@lowering(torch.cummin, "method:cummin", "aten.cummin")
def lower_cummin(ctx, x, dim, *, out=None):
    return _running_extreme(ctx, x, dim, "min")


# ---------------------------------------------------------------- log-sum-exp

def _log_add_exp(a: Expr, b: Expr) -> Expr:
    """log(exp(a) + exp(b)) shifted by the larger (by 0 where that is infinite: all -inf gives -inf, an inf inf)."""
    return _shifted_log(call("max", a, b), lambda shift: call("add", call("exp", call("sub", a, shift)),
                                                              call("exp", call("sub", b, shift))))


def _shifted_log(peak: Expr, total_at: Callable[[Expr], Expr]) -> Expr:
    shift = call("where", call("eq", call("abs", peak), Const(math.inf)), Const(0.0), peak)
    return call("add", call("log", total_at(shift)), shift)


def _log_sum_exp(acc: torch.dtype) -> _Scan:
    """State log(sum exp(x_j)): each window's running maximum m_i, then log(sum_j exp(x_j - m_i)) + m_i."""
    def window(ctx, term, shape, win, dtypes):
        b, tag = ctx.builder, ctx.builder.new_tag("logcumsumexp")

        def running_max(o, r, rg):
            return call("where", win.keep(o, r, rg), term(win.at(o, r, rg), rg)[0], Const(-math.inf))

        peak = b.emit(shape, acc, running_max, reduce="max", red_shape=[win.block], tag=tag, hint=f"{ctx.hint}_max")
        shift = b.emit(shape, acc, lambda o, r, rg: call("where", call("eq", call("abs", peak.read(o, rg)),
                                                                         Const(math.inf)), Const(0.0), peak.read(o, rg)),
                       tag=tag, hint=f"{ctx.hint}_shift")

        def terms(o, r, rg):
            e = call("exp", call("sub", term(win.at(o, r, rg), rg)[0], shift.read(o, rg)))
            return call("where", win.keep(o, r, rg), e, Const(0.0))

        total = b.emit(shape, acc, terms, reduce="sum", red_shape=[win.block], tag=tag, hint=f"{ctx.hint}_sum")
        return (b.emit(shape, dtypes[0], lambda o, r, rg: call("add", call("log", total.read(o, rg)), shift.read(o, rg)),
                       tag=tag, hint=ctx.hint),)

    return _Scan(window, lambda earlier, later: (_log_add_exp(earlier[0], later[0]),), (acc,))


@lowering(torch.logcumsumexp, "method:logcumsumexp", "aten.logcumsumexp")
def lower_logcumsumexp(ctx, x, dim, *, out=None):
    """log(sum_{j<=i} exp(x_j)), each window shifted by its running maximum (float32 for half precision)."""
    if x.rank == 0:
        return x
    dim = V.norm_dim(dim, x.rank)
    op = _log_sum_exp(compute_dtype(x.dtype))
    return _scan(ctx, op, lambda coords, rg: (upcast(x.read(coords, rg), x),), list(x.shape), dim, (ctx.dtype,))[0]
