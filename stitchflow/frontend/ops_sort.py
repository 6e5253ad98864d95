"""Sorting along a dim (topk, sort, argsort, kthvalue, median, msort): each element's rank is a count
over its row, rank[e] = #{f : x[f] comes before x[e]}, and the j-th output is the one element of rank
j. Order is stable (equal values keep their order) and NaN sorts as the largest value, as torch's sort.

A short dim (up to QUADRATIC_SORT) counts its ranks pairwise: n² work in reductions that fuse with what
comes before (a mixture-of-experts router's top-k over its experts, after the softmax). A longer one is
merge-ranked, as a GPU merge sort's last pass: the dim is cut into blocks of SORT_BLOCK, each block is
ranked pairwise and put in order (a scatter of its positions), and an element's rank is its rank in its
own block plus, for every other block, how many of that block's elements come before it: a binary search
of the sorted block, one gather a step (n·SORT_BLOCK + n·(n / SORT_BLOCK)·log2(SORT_BLOCK) work). The
sorted row is then a scatter of each element's position to its rank (a permutation) and a gather."""

from __future__ import annotations

import math

import torch

from ..ir.errors import UnsupportedOpError
from ..ir.expr import Cast, Const, IndexValue, call
from ..ir.index import Gather, add, floordiv, mod, scale
from . import values as V
from .registry import LowerCtx, compute_dtype, lowering, upcast
from .values import TensorValue

QUADRATIC_SORT = 1024  # dims up to this long are ranked pairwise (n² comparisons a row)
SORT_BLOCK = 1024  # a longer dim's blocks (a power of two: the binary searches halve it)
# the binary searches keep one position per element and block: a sort whose searches would hold more is refused
# (a 150000-word vocabulary's sort holds 22M for one row; eight rows would hold 176M, 1.4 GB a search step)
MAX_SEARCHED = 1 << 25


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
    if x.dtype == torch.bool or x.dtype.is_complex:
        raise UnsupportedOpError(what, f"{x.dtype} values", ctx.hint)
    return x.shape[dim]


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


# ---------------------------------------------------------------- long dims: merge ranks

def _gathered(t: TensorValue, coords, rg):
    """t's integer at coords, as an index."""
    access = t.access(coords, rg)
    return Gather(access.tensor, access.indices)


def counted_prefix(ctx: LowerCtx, shape, length: int, holds, tag=None) -> TensorValue:
    """int64 count, for each o of `shape`, of the k in [0, length) where holds(o, k, rg), which must hold on a
    prefix (a sorted run's elements before a value): binary lifting, one node a halving, each a gather at the
    count so far (log2(length) + 1 nodes, not `length` comparisons)."""
    found, step = None, 1 << (length.bit_length() - 1)
    while step:
        def lift(o, r, rg, found=found, step=step):
            k = add(_gathered(found, o, rg) if found else 0, step - 1)  # read clamped where k passes the end
            taken = call("and", call("lt", IndexValue(k), Const(length)), holds(list(o), k, rg))
            taken = call("where", taken, Const(step), Const(0))
            return call("add", found.read(o, rg), taken) if found else taken
        found = ctx.builder.emit(list(shape), torch.int64, lift, tag=tag, hint=f"{ctx.hint}_search")
        step //= 2
    return found


def _merge_ranks(ctx: LowerCtx, x: TensorValue, dim: int, descending: bool, tag, what: str) -> TensorValue:
    """int64 rank of each element of a long dim: its rank in its own block, plus for each other block how many
    of its elements come before it (equal ones too where that block is earlier), found by binary search."""
    n, block, b = x.shape[dim], SORT_BLOCK, ctx.builder
    blocks = -(-n // block)
    if math.prod(x.shape) * blocks > MAX_SEARCHED:
        raise UnsupportedOpError(what, f"{math.prod(x.shape)} elements in rows of {n}: "
                                 f"merging its blocks of {block} would search {math.prod(x.shape) * blocks} element "
                                 f"and block pairs (at most {MAX_SEARCHED} are lowered)", ctx.hint)

    def value(coords, rg):
        return upcast(x.read(coords, rg), x)

    def own_block(o, r, rg):
        j = add(o[dim], scale(mod(o[dim], block, rg), -1), r[0])
        before = _comes_before(value(_at(o, dim, j), rg), value(o, rg), IndexValue(j), IndexValue(o[dim]), descending)
        return call("where", call("and", call("lt", IndexValue(j), Const(n)), before), Const(1), Const(0))

    local = b.emit(x.shape, torch.int64, own_block, reduce="sum", red_shape=[block], tag=tag,
                   hint=f"{ctx.hint}_block_rank")
    padded = _at(x.shape, dim, blocks * block)

    def slot(o, rg):  # element o's place in its block's sorted run
        return _at(o, dim, add(o[dim], scale(mod(o[dim], block, rg), -1), _gathered(local, o, rg)))

    # a scatter from zeros: the last run's slots past the dim's end hold 0, and no search takes them
    order = b.scatter(padded, torch.int64, list(x.shape), lambda o, r, rg: IndexValue(o[dim]), slot,
                      hint=f"{ctx.hint}_block_order")
    runs = b.emit(padded, x.dtype, lambda o, r, rg: x.read(_at(o, dim, _gathered(order, o, rg)), rg), tag=tag,
                  hint=f"{ctx.hint}_runs")

    def precedes(o, run, k, rg):
        """The k-th of run `run` comes before element o (o: the element's coordinates)."""
        at = add(scale(run, block), k)
        earlier = _comes_before(upcast(runs.read(_at(o, dim, at), rg), x),
                                value(o, rg), IndexValue(run), IndexValue(floordiv(o[dim], block, rg)), descending)
        return call("and", call("lt", IndexValue(at), Const(n)), earlier)

    # found[o, c]: how many of run c come before element o
    found = counted_prefix(ctx, [*x.shape, blocks], block, lambda o, k, rg: precedes(list(o[:-1]), o[-1], k, rg), tag)

    def before_in_other_runs(o, r, rg):
        own = call("eq", IndexValue(r[0]), IndexValue(floordiv(o[dim], block, rg)))
        return call("where", own, Const(0), found.read([*o, r[0]], rg))

    across = b.emit(x.shape, torch.int64, before_in_other_runs, reduce="sum", red_shape=[blocks], tag=tag,
                    hint=f"{ctx.hint}_merged_rank")
    return b.emit(x.shape, torch.int64, lambda o, r, rg: call("add", local.read(o, rg), across.read(o, rg)), tag=tag,
                  hint=f"{ctx.hint}_rank")


def _merged(ctx: LowerCtx, x: TensorValue, dim: int, descending: bool, tag, what: str):
    """(values, int64 indices) of x sorted along a long dim: each position scattered to its rank, then gathered."""
    b = ctx.builder
    rank = _merge_ranks(ctx, x, dim, descending, tag, what)
    source = b.scatter(x.shape, torch.int64, list(x.shape), lambda o, r, rg: IndexValue(o[dim]),
                       lambda o, rg: _at(o, dim, _gathered(rank, o, rg)), hint=f"{ctx.hint}_index")
    values = b.emit(x.shape, x.dtype, lambda o, r, rg: x.read(_at(o, dim, _gathered(source, o, rg)), rg), tag=tag,
                    hint=ctx.hint)
    return values, source


def sorted_along(ctx: LowerCtx, x: TensorValue, dim: int, count: int, descending: bool, what: str):
    """(values, int64 indices) of the first `count` elements of x sorted along `dim`, that dim of size count."""
    if x.rank == 0:
        return x, _zeros_like(ctx, x)
    dim = V.norm_dim(dim, x.rank)
    if _checked_length(ctx, x, dim, what) == 1:
        return x, _zeros_like(ctx, x)
    tag = ctx.builder.new_tag("sort")
    if x.shape[dim] > QUADRATIC_SORT:
        values, indices = _merged(ctx, x, dim, descending, tag, what)
        return V.slice_dim(values, dim, 0, count, 1), V.slice_dim(indices, dim, 0, count, 1)
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
    shape = [1 if d == dim else size for d, size in enumerate(x.shape) if keepdim or d != dim]

    def row(o, e):
        return _at(o, dim, e) if keepdim else list(o[:dim]) + [e] + list(o[dim:])

    numbers = b.emit(shape, torch.float32, lambda o, r, rg: call("where", call("eq", x.read(row(o, r[0]), rg),
                                                                               x.read(row(o, r[0]), rg)),
                                                                 Const(1.0), Const(0.0)),
                     reduce="sum", red_shape=[n], tag=tag, hint=f"{ctx.hint}_numbers")
    if n > QUADRATIC_SORT:
        return _long_median(ctx, x, dim, shape, row, numbers, tag)
    rank = _ranks(ctx, x, dim, False, tag)
    middle = Const(float((n - 1) // 2))
    # sorted NaNs come after the numbers, the first NaN by position first: its rank is the count of numbers
    wanted = (lambda o, rg: call("where", call("lt", numbers.read(o, rg), Const(float(n))), numbers.read(o, rg), middle))
    return _picked(ctx, x, rank, dim, shape, row, wanted, tag)


def _long_median(ctx, x, dim, shape, row, numbers, tag):
    """The median of a long dim: the merged sort's element at (n - 1) // 2, or at the count of numbers (the
    first NaN) where the row holds NaN."""
    n, b = x.shape[dim], ctx.builder
    values, indices = _merged(ctx, x, dim, False, tag, "median")
    position = b.emit(shape, torch.int64, lambda o, r, rg: call("where", call("lt", numbers.read(o, rg), Const(float(n))),
                                                                Cast(torch.int64, numbers.read(o, rg)),
                                                                Const((n - 1) // 2)), tag=tag, hint=f"{ctx.hint}_middle")
    return tuple(b.emit(shape, t.dtype, lambda o, r, rg, t=t: t.read(row(o, _gathered(position, o, rg)), rg), tag=tag,
                        hint=ctx.hint) for t in (values, indices))


# ---------------------------------------------------------------- insertion points

@lowering(torch.searchsorted, "aten.searchsorted")
def lower_searchsorted(ctx, sorted_sequence, values, *, out_int32=False, right=False, side=None, sorter=None,
                       out=None):
    """Where each value would be inserted into its row of the sorted sequence (the last dim; a 1-d sequence serves
    every value): how many of the row's elements come before it, those below it (side "left") or not above it
    ("right"). A NaN value goes last, as in torch; NaN elements sort last, as torch.sort puts them (torch's own
    search lands among them where its probes happen to fall)."""
    if side is not None:
        right = side == "right"
    return _insertion_points(ctx, sorted_sequence, values, right, sorter, "searchsorted")


@lowering(torch.bucketize, "aten.bucketize")
def lower_bucketize(ctx, values, boundaries, *, out_int32=False, right=False, out=None):
    """The bucket of each value among 1-d sorted boundaries: searchsorted's insertion point (right=False counts the
    boundaries below the value)."""
    return _insertion_points(ctx, boundaries, values, right, None, "bucketize")


def _insertion_points(ctx: LowerCtx, sequence, values, right: bool, sorter, what: str) -> TensorValue:
    if not isinstance(sequence, TensorValue) or sequence.rank == 0:
        raise UnsupportedOpError(what, "a sequence that is not a tensor of at least one dim", ctx.hint)
    if sequence.dtype == torch.bool or sequence.dtype.is_complex:
        raise UnsupportedOpError(what, f"a sequence of {sequence.dtype}", ctx.hint)
    length, rows = sequence.shape[-1], sequence.rank > 1
    if sorter is not None and not isinstance(sorter, TensorValue):
        sorter = ctx.builder.add_param("sorter", sorter)

    def holds(o, k, rg):  # element k of o's row comes before the value at o
        row = list(o[:-1]) if rows else []
        if sorter is not None:
            k = _gathered(sorter, [*row, k], rg)
        element = upcast(sequence.read([*row, k], rg), sequence)
        value = upcast(values.read(o, rg), values) if isinstance(values, TensorValue) else Const(values)
        return call("or", call("le" if right else "lt", element, value), call("ne", value, value))

    if length <= QUADRATIC_SORT:  # a count over the row, fused with what comes next
        count = ctx.builder.emit(ctx.shape, ctx.dtype, lambda o, r, rg: call("where", holds(o, r[0], rg), Const(1),
                                                                             Const(0)),
                                 reduce="sum", red_shape=[length], hint=ctx.hint)
        return count
    found = counted_prefix(ctx, ctx.shape, length, holds)
    return found if ctx.dtype == torch.int64 else ctx.builder.emit(
        ctx.shape, ctx.dtype, lambda o, r, rg: Cast(ctx.dtype, found.read(o, rg)), hint=ctx.hint)
