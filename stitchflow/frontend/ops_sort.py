"""Sorting along a short dim (topk, sort, argsort, kthvalue, median, msort): each element's rank is a
count over its row, rank[e] = #{f : x[f] comes before x[e]}, and the j-th output is the one element
of rank j. Quadratic in the dim's length, so only short dims are taken: a mixture-of-experts router's
top-k over its experts fuses with the softmax before it. Order is stable (equal values keep their
order) and NaN sorts as the largest value, as torch's sort does."""

from __future__ import annotations

import math

import torch

from ..ir.errors import UnsupportedOpError
from ..ir.expr import Cast, Const, IndexValue, call
from . import values as V
from .registry import LowerCtx, compute_dtype, lowering, upcast
from .values import TensorValue

MAX_SORTED = 1024  # the rank of n elements costs n^2 comparisons a row


def _comes_before(a, b, ia, ib, descending: bool):
    """a (at position ia) sorts before b (at ib): larger first when descending, NaN the largest, ties by position."""
    nan_a, nan_b = call("ne", a, a), call("ne", b, b)
    if descending:
        strictly = call("or", call("gt", a, b), call("and", nan_a, call("not", nan_b)))
    else:
        strictly = call("or", call("lt", a, b), call("and", nan_b, call("not", nan_a)))
    same = call("or", call("eq", a, b), call("and", nan_a, nan_b))
    return call("or", strictly, call("and", same, call("lt", ia, ib)))


def _checked_length(ctx: LowerCtx, x: TensorValue, dim: int, what: str) -> int:
    n = x.shape[dim]
    if n > MAX_SORTED:
        raise UnsupportedOpError(what, f"{n} elements along dim {dim}: ranks are counted pairwise, which is taken up "
                                       f"to {MAX_SORTED}", ctx.hint)
    if x.dtype == torch.bool or x.dtype.is_complex:
        raise UnsupportedOpError(what, f"{x.dtype} values", ctx.hint)
    return n


def _at(o, dim: int, position):
    return list(o[:dim]) + [position] + list(o[dim + 1:])


def _zeros_like(ctx: LowerCtx, x: TensorValue) -> TensorValue:
    """The indices of a dim of one element."""
    return ctx.builder.emit(x.shape, torch.int64, lambda o, r, rg: Const(0), hint=f"{ctx.hint}_index")


def _ranks(ctx: LowerCtx, x: TensorValue, dim: int, descending: bool, tag) -> TensorValue:
    """rank[..., e, ...]: how many elements of e's row sort before it (float32 counts: exact far past MAX_SORTED)."""
    n = x.shape[dim]

    def body(o, r, rg):
        mine, other = upcast(x.read(o, rg), x), upcast(x.read(_at(o, dim, r[0]), rg), x)
        before = _comes_before(other, mine, IndexValue(r[0]), IndexValue(o[dim]), descending)
        return call("where", before, Const(1.0), Const(0.0))

    return ctx.builder.emit(x.shape, torch.float32, body, reduce="sum", red_shape=[n], tag=tag, hint=f"{ctx.hint}_rank")


def _picked(ctx: LowerCtx, x: TensorValue, rank: TensorValue, dim: int, shape, row, wanted, tag):
    """(value, int64 index) of the element whose rank is wanted(o, rg), for outputs of `shape`; row(o, e) are the
    coordinates of element e of output o's row."""
    n = x.shape[dim]
    acc = compute_dtype(x.dtype)
    lowest = Const(float("-inf")) if acc.is_floating_point else Const(torch.iinfo(acc).min)

    def holder(o, r, rg):
        return call("eq", rank.read(row(o, r[0]), rg), wanted(o, rg))

    b = ctx.builder
    values = b.emit(shape, x.dtype, lambda o, r, rg: call("where", holder(o, r, rg), upcast(x.read(row(o, r[0]), rg), x),
                                                          lowest), reduce="max", red_shape=[n], tag=tag, hint=ctx.hint)
    indices = b.emit(shape, torch.int64, lambda o, r, rg: call("where", holder(o, r, rg), Cast(torch.int64, IndexValue(r[0])),
                                                               Const(0)), reduce="sum", red_shape=[n], tag=tag,
                     hint=f"{ctx.hint}_index")
    return values, indices


def sorted_along(ctx: LowerCtx, x: TensorValue, dim: int, count: int, descending: bool, what: str):
    """(values, int64 indices) of the first `count` elements of x sorted along `dim`, that dim of size count."""
    if x.rank == 0:
        return x, _zeros_like(ctx, x)
    dim = V.norm_dim(dim, x.rank)
    if _checked_length(ctx, x, dim, what) == 1:
        return x, _zeros_like(ctx, x)
    tag = ctx.builder.new_tag("sort")
    rank = _ranks(ctx, x, dim, descending, tag)
    shape = list(x.shape)
    shape[dim] = count
    return _picked(ctx, x, rank, dim, shape, lambda o, e: _at(o, dim, e),
                   lambda o, rg: Cast(torch.float32, IndexValue(o[dim])), tag)


@lowering(torch.topk, "method:topk", "aten.topk")
def lower_topk(ctx, x, k, dim=-1, largest=True, sorted=True, *, out=None):
    """sorted=False may return any order; this returns the sorted one."""
    return sorted_along(ctx, x, dim, int(k), largest, "topk")


@lowering(torch.sort, "method:sort", "aten.sort")
def lower_sort(ctx, x, dim=-1, descending=False, stable=False, *, out=None):
    return sorted_along(ctx, x, dim, x.shape[V.norm_dim(dim, x.rank)] if x.rank else 1, descending, "sort")


@lowering(torch.argsort, "method:argsort", "aten.argsort")
def lower_argsort(ctx, x, dim=-1, descending=False, stable=False):
    return lower_sort(ctx, x, dim, descending)[1]


@lowering(torch.msort, "method:msort", "aten.msort")
def lower_msort(ctx, x):
    return lower_sort(ctx, x, 0)[0]


def _kth(ctx, x, k: int, dim: int, keepdim: bool, what: str):
    """The k-th smallest (1-based) along dim and its index, as torch.kthvalue."""
    values, indices = sorted_along(ctx, x, dim, k, False, what)
    dim = V.norm_dim(dim, x.rank)
    values, indices = V.select(values, dim, k - 1), V.select(indices, dim, k - 1)
    if keepdim:
        values, indices = V.unsqueeze(values, dim), V.unsqueeze(indices, dim)
    return values, indices


@lowering(torch.kthvalue, "method:kthvalue", "aten.kthvalue")
def lower_kthvalue(ctx, x, k, dim=-1, keepdim=False, *, out=None):
    return _kth(ctx, x, int(k), dim, keepdim, "kthvalue")


@lowering(torch.median, "method:median", "aten.median")
def lower_median(ctx, x, dim=None, keepdim=False, *, out=None):
    """The lower median, element (n - 1) // 2 in ascending order; a row holding NaN gives its first NaN (its
    value and index), as torch. Over the flattened tensor when no dim is given (the value only)."""
    if dim is None:
        flat = V.reshape(x, [math.prod(x.shape)])
        return lower_median(ctx, flat, 0, False)[0]
    dim = V.norm_dim(dim, x.rank)
    n = _checked_length(ctx, x, dim, "median")
    if n == 1:
        values = x if keepdim else V.select(x, dim, 0)
        return values, _zeros_like(ctx, values)
    b, tag = ctx.builder, ctx.builder.new_tag("median")
    rank = _ranks(ctx, x, dim, False, tag)
    shape = [1 if d == dim else size for d, size in enumerate(x.shape) if keepdim or d != dim]

    def row(o, e):
        return _at(o, dim, e) if keepdim else list(o[:dim]) + [e] + list(o[dim:])

    numbers = b.emit(shape, torch.float32, lambda o, r, rg: call("where", call("eq", x.read(row(o, r[0]), rg),
                                                                               x.read(row(o, r[0]), rg)),
                                                                 Const(1.0), Const(0.0)),
                     reduce="sum", red_shape=[n], tag=tag, hint=f"{ctx.hint}_numbers")
    middle = Const(float((n - 1) // 2))
    # sorted NaNs come after the numbers, the first NaN by position first: its rank is the count of numbers
    wanted = (lambda o, rg: call("where", call("lt", numbers.read(o, rg), Const(float(n))), numbers.read(o, rg), middle))
    return _picked(ctx, x, rank, dim, shape, row, wanted, tag)
