"""Lowerings of scatters: ops that write into a tensor at computed positions (torch_geometric's message
aggregation by sum, mean, max or min; an embedding's gradient; a KV cache's update by index_copy; a MoE
router's unsort `inv[perm] = arange(n)`). Each is a loop whose point o writes value(o) at position at(o)
of the output, lowered to one or two scatter nodes (the IR's `out[at] op= value`, starting at the
reduction's identity) and one elementwise node that combines them with the tensor written into:

- reductions (scatter_add, index_add, scatter_reduce, index_reduce, index_put with accumulate): the base
  combined with the scattered sum, product, maximum or minimum; `include_self=False` and the mean count the
  values that reach each position (a second scatter, of ones);
- overwrites (scatter with a source, index_put, index_copy): the last point to write a position wins, as in
  eager's sequential CPU kernels and its deterministic mode (eager's parallel kernels leave the choice among
  duplicates undefined). A max-scatter of each point's loop position plus one tells every output position
  which point wrote it last (0: none), and the output reads the source there. Where one value is written
  everywhere (index_fill, scatter of a scalar, x[idx] = 0) only whether a point wrote is needed."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..ir.errors import ShapeError, UnsupportedOpError
from ..ir.expr import Cast, Const, Expr, IndexValue, call
from ..ir.index import Gather, IndexExpr, Lit, Var, add, floordiv, mod, scale
from . import values as V
from .ops_index import _as
from .registry import compute_dtype, lowering, sub_ctx
from .values import TensorValue

IndexFn = Callable[[list, dict], list]  # (loop point, ranges) -> the output position it writes


@dataclass(frozen=True)
class Writes:
    """A scatter's loop: the point o of a loop of `shape` writes `source` (read at o: as large as the loop in
    every dim, or larger; a number is written everywhere) at the output position `at(o, ranges)`."""

    shape: tuple[int, ...]
    at: IndexFn
    source: object

    def value(self, coords, ranges) -> Expr:
        """The source at a loop point, given as index expressions (plain variables, or a gathered position)."""
        if not isinstance(self.source, TensorValue):
            return Const(self.source.item() if isinstance(self.source, torch.Tensor) else self.source)
        return self.source.read(list(coords), ranges)

    @property
    def one_value(self) -> bool:
        return not isinstance(self.source, TensorValue) or math.prod(self.source.shape) == 1


def _scatter(ctx, writes: Writes, reduce: str, dtype: torch.dtype, body=None, step="scatter") -> TensorValue:
    """out[at(o)] (reduce)= body(o) over the loop, out in ctx's shape; body defaults to the source."""
    body = body or (lambda o, rg: writes.value(o, rg))
    return ctx.builder.scatter(ctx.shape, dtype, list(writes.shape), lambda o, r, rg: body(o, rg), writes.at,
                               reduce=reduce, hint=f"{ctx.hint}_{step}")


def _count(ctx, writes: Writes) -> TensorValue:
    """How many loop points write each output position."""
    return _scatter(ctx, writes, "sum", torch.int64, lambda o, rg: Const(1), "count")


def _is_zero_constant(ctx, v: TensorValue) -> bool:
    value = ctx.builder.param_values.get(v.base)
    return value is not None and ctx.builder.is_whole(v) and not bool(value.any())


def _combine(ctx, fn) -> TensorValue:
    return ctx.builder.emit(ctx.shape, ctx.dtype, fn, hint=ctx.hint)


# ---------------------------------------------------------------- reductions

IR_REDUCTION = {"sum": "sum", "prod": "prod", "amax": "max", "amin": "min", "mean": "sum"}
COMBINE = {"sum": "add", "prod": "mul", "amax": "max", "amin": "min"}


def reduce_into(ctx, base: TensorValue, writes: Writes, reduce: str, include_self: bool = True) -> TensorValue:
    """base with the loop's values reduced into it, as scatter_reduce(reduce, include_self) does."""
    if reduce not in IR_REDUCTION:
        raise UnsupportedOpError("scatter_reduce", f"reduce={reduce!r} (sum, prod, mean, amax and amin are "
                                                   "lowered)", ctx.hint)
    if ctx.dtype == torch.bool and reduce != "sum":
        raise UnsupportedOpError("scatter_reduce", f"reduce={reduce!r} over booleans", ctx.hint)
    exact = reduce in ("amax", "amin") or not ctx.dtype.is_floating_point
    acc = ctx.dtype if exact else compute_dtype(ctx.dtype)
    scattered = _scatter(ctx, writes, IR_REDUCTION[reduce], acc)
    if reduce == "sum" and include_self and _is_zero_constant(ctx, base):
        return scattered if acc == ctx.dtype else _combine(ctx, lambda o, r, rg: Cast(ctx.dtype, scattered.read(o, rg)))
    count = _count(ctx, writes) if reduce == "mean" or not include_self else None

    def body(o, r, rg):
        b, s = base.read(o, rg), scattered.read(o, rg)
        if reduce == "mean":
            value = _mean(_acc(b, acc, base), s, count.read(o, rg), acc, include_self)
        else:
            value = call(COMBINE[reduce], _acc(b, acc, base), s) if include_self else s
        if not include_self:
            value = call("where", call("gt", count.read(o, rg), Const(0)), value, _acc(b, acc, base))
        return value if acc == ctx.dtype else Cast(ctx.dtype, value)

    return _combine(ctx, body)


def _mean(base: Expr, total: Expr, count: Expr, acc: torch.dtype, include_self: bool) -> Expr:
    """scatter_reduce's mean: the base counts as one more value when included; integers divide rounding down.
    (Where nothing was written and the base is left out, the caller keeps the base.)"""
    if include_self:
        total, count = call("add", base, total), call("add", count, Const(1))
    else:
        count = call("max", count, Const(1))
    if acc.is_floating_point:
        return call("div", total, Cast(acc, count))
    return call("floordiv", total, count)


def _acc(e: Expr, acc: torch.dtype, v: TensorValue) -> Expr:
    return e if v.dtype == acc else Cast(acc, e)


# ---------------------------------------------------------------- overwrites

def overwrite(ctx, base: TensorValue, writes: Writes) -> TensorValue:
    """base with the loop's values written at their positions, the last point's value where several write."""
    if writes.one_value:
        count = _count(ctx, writes)
        single = writes.source
        value = writes.value([Lit(0)] * single.rank, {}) if isinstance(single, TensorValue) else writes.value([], {})
        return _combine(ctx, lambda o, r, rg: call("where", call("gt", count.read(o, rg), Const(0)),
                                                  _as(value, writes.source, ctx.dtype), base.read(o, rg)))
    strides = [math.prod(writes.shape[k + 1:]) for k in range(len(writes.shape))]
    last = _scatter(ctx, writes, "max", torch.int64,
                    lambda o, rg: IndexValue(add(*(scale(v, s) for v, s in zip(o, strides)), 1)), "last")

    def body(o, r, rg):
        read = last.access(o, rg)
        flat = add(Gather(read.tensor, read.indices), -1)
        coords = [mod(floordiv(flat, s, rg), n, rg) for s, n in zip(strides, writes.shape)]
        return call("where", call("gt", last.read(o, rg), Const(0)),
                    _as(writes.value(coords, rg), writes.source, ctx.dtype), base.read(o, rg))

    return _combine(ctx, body)


# ---------------------------------------------------------------- where each op writes

def _scalar_as_vector(lower):
    """A scatter into a 0-d tensor (dim 0 of a scalar, OpInfo's samples) lowered on views of shape [1]."""
    @functools.wraps(lower)
    def lowered(ctx, x, dim, index, *rest, **kwargs):
        if not isinstance(x, TensorValue) or x.rank:
            return lower(ctx, x, dim, index, *rest, **kwargs)

        def vector(v):
            return V.reshape(v, [1]) if isinstance(v, TensorValue) and v.rank == 0 else v

        V.norm_dim(dim, 0)  # 0 or -1
        out = lower(sub_ctx(ctx, [1], ctx.dtype, "vector"), vector(x), 0, vector(index), *map(vector, rest),
                    **{k: vector(v) for k, v in kwargs.items()})
        return V.reshape(out, [])

    return lowered


def _index_tensor(ctx, index) -> TensorValue:
    """The index as a value: a graph tensor as it is, a constant one as a parameter."""
    return index if isinstance(index, TensorValue) else ctx.builder.add_param("index", index)


def _along(ctx, dim: int, index) -> tuple[TensorValue, IndexFn]:
    """scatter's map: loop point o writes at o with coordinate `dim` replaced by index[o]."""
    index = _index_tensor(ctx, index)

    def at(o, rg):
        acc = index.access(o, rg)
        return [Gather(acc.tensor, acc.indices) if d == dim else o[d] for d in range(len(o))]

    return index, at


def _by_list(ctx, dim: int, index, rank: int) -> IndexFn:
    """index_add's map: loop point o writes at o with coordinate `dim` replaced by index[o[dim]]."""
    index = _index_tensor(ctx, index)

    def at(o, rg):
        acc = index.access([o[dim]], rg) if index.rank else index.access([], rg)
        return [Gather(acc.tensor, acc.indices) if d == dim else o[d] for d in range(rank)]

    return at


def _source_shape(x: TensorValue, dim: int, index) -> tuple[int, ...]:
    n = math.prod(index.shape) if hasattr(index, "shape") else 1
    return tuple(n if d == dim else s for d, s in enumerate(x.shape))


@lowering(torch.scatter_add, "method:scatter_add", "method:scatter_add_", "aten.scatter_add", "aten.scatter_add_")
@_scalar_as_vector
def lower_scatter_add(ctx, base, dim, index, src):
    dim = V.norm_dim(dim, base.rank)
    index, at = _along(ctx, dim, index)
    return reduce_into(ctx, base, Writes(tuple(index.shape), at, src), "sum")


@lowering("method:scatter_reduce", "method:scatter_reduce_", torch.scatter_reduce, "aten.scatter_reduce")
@_scalar_as_vector
def lower_scatter_reduce(ctx, base, dim, index, src, reduce, *, include_self=True):
    dim = V.norm_dim(dim, base.rank)
    index, at = _along(ctx, dim, index)
    return reduce_into(ctx, base, Writes(tuple(index.shape), at, src), reduce, include_self)


@lowering("aten.scatter", "method:scatter", "method:scatter_", torch.scatter)
@_scalar_as_vector
def lower_scatter(ctx, x, dim, index, value=None, *, src=None, reduce=None):
    """x with src[o] (or a number) written at o with coordinate dim replaced by index[o]; with reduce "add" or
    "multiply" (the deprecated spelling of scatter_reduce) combined instead."""
    source = src if value is None else value
    dim = V.norm_dim(dim, x.rank)
    if reduce is None and not isinstance(source, TensorValue) and isinstance(index, TensorValue) and \
            index.shape[dim] == 1 and all(n == m for d, (n, m) in enumerate(zip(index.shape, x.shape)) if d != dim):
        return _one_hot_write(ctx, x, dim, index, source)
    index, at = _along(ctx, dim, index)
    writes = Writes(tuple(index.shape), at, source)
    if reduce is None:
        return overwrite(ctx, x, writes)
    kinds = {"add": "sum", "multiply": "prod"}
    if reduce not in kinds:
        raise UnsupportedOpError("scatter", f"reduce={reduce!r} (add and multiply)", ctx.hint)
    return reduce_into(ctx, x, writes, kinds[reduce])


def _one_hot_write(ctx, x, dim, index, value):
    """A number written at one index per row along dim (NLL's gradient: a one-hot times -1) needs no scatter:
    where(index[..., 0, ...] == coordinate, value, x), elementwise."""
    def body(o, r, rg):
        at = index.read([Lit(0) if d == dim else o[d] for d in range(x.rank)], rg)
        return call("where", call("eq", at, IndexValue(o[dim])), _as(Const(value), value, ctx.dtype), x.read(o, rg))

    return ctx.builder.emit(ctx.shape, ctx.dtype, body, hint=ctx.hint)


@lowering(torch.index_add, "method:index_add", "method:index_add_", "aten.index_add", "aten.index_add_")
@_scalar_as_vector
def lower_index_add(ctx, base, dim, index, source, *, alpha=1):
    dim = V.norm_dim(dim, base.rank)
    if alpha != 1 and isinstance(source, TensorValue):
        source = _scaled(ctx, source, alpha)
    at = _by_list(ctx, dim, index, base.rank)
    return reduce_into(ctx, base, Writes(tuple(source.shape), at, source), "sum")


def _scaled(ctx, v: TensorValue, alpha) -> TensorValue:
    return ctx.builder.emit(v.shape, v.dtype, lambda o, r, rg: call("mul", v.read(o, rg), Const(alpha)),
                            hint=f"{ctx.hint}_alpha")


@lowering(torch.index_reduce, "method:index_reduce", "method:index_reduce_", "aten.index_reduce",
          "aten.index_reduce_")
@_scalar_as_vector
def lower_index_reduce(ctx, base, dim, index, source, reduce, *, include_self=True):
    dim = V.norm_dim(dim, base.rank)
    at = _by_list(ctx, dim, index, base.rank)
    return reduce_into(ctx, base, Writes(tuple(source.shape), at, source), reduce, include_self)


@lowering(torch.index_copy, "method:index_copy", "method:index_copy_", "aten.index_copy", "aten.index_copy_")
@_scalar_as_vector
def lower_index_copy(ctx, x, dim, index, source):
    """x with source's slices written at index along dim (a static KV cache's update at the new positions)."""
    dim = V.norm_dim(dim, x.rank)
    if isinstance(source, TensorValue) and source.rank and tuple(source.shape) != _source_shape(x, dim, index):
        raise ShapeError(f"index_copy: source of shape {list(source.shape)} for {list(x.shape)} at "
                         f"{math.prod(getattr(index, 'shape', ()))} indices along dim {dim}")
    at = _by_list(ctx, dim, index, x.rank)
    return overwrite(ctx, x, Writes(_source_shape(x, dim, index), at, source))


@lowering(torch.index_fill, "method:index_fill", "method:index_fill_", "aten.index_fill", "aten.index_fill_")
@_scalar_as_vector
def lower_index_fill(ctx, x, dim, index, value):
    """x with `value` at every position whose coordinate along dim is listed in index."""
    if isinstance(value, TensorValue) and math.prod(value.shape) != 1:
        raise UnsupportedOpError("index_fill", "a value that is not a number or a 0-d tensor", ctx.hint)
    dim = V.norm_dim(dim, x.rank)
    at = _by_list(ctx, dim, index, x.rank)
    return overwrite(ctx, x, Writes(_source_shape(x, dim, index), at, value))


@lowering("aten.index_put", "aten.index_put_", torch.index_put, "method:index_put", "method:index_put_")
def lower_index_put(ctx, x, indices, values, accumulate=False):
    """x with values written (accumulate: added) at x[indices]: an embedding's gradient (rows summed into the
    table), a nearest upsampling's (x[:, :, rows[:, None], cols] with None for the whole dims), x[idx] = v.
    The index tensors broadcast together and stand next to each other (None entries before them or after);
    values broadcast to x's leading dims, the index shape and x's trailing dims."""
    indices = list(indices)
    at = [d for d, i in enumerate(indices) if i is not None]
    if not at or any(not isinstance(indices[d], TensorValue) for d in at):
        raise UnsupportedOpError("index_put", "index entries other than tensors and None", ctx.hint)
    if at != list(range(at[0], at[-1] + 1)):
        raise UnsupportedOpError("index_put", "index tensors apart (eager moves their dims first)", ctx.hint)
    tensors = [indices[d] for d in at]
    if len(tensors) == 1 and at == [0] and tensors[0].dtype == torch.bool:  # x[mask] = v, x[mask] += v
        from .ops_index import set_masked
        return set_masked(ctx, x, tensors[0], values, accumulate)
    if any(i.dtype == torch.bool for i in tensors):
        raise UnsupportedOpError("index_put", "a boolean mask index among others, or after a whole dim",
                                 ctx.hint)
    try:
        shape = list(torch.broadcast_shapes(*(tuple(i.shape) for i in tensors)))
    except RuntimeError as err:
        raise ShapeError(f"index_put: index tensors of shapes {[list(i.shape) for i in tensors]} do not "
                         f"broadcast") from err
    first, rank = at[0], len(shape)
    loop_shape = (*x.shape[:first], *shape, *x.shape[first + len(at):])
    tensors = [V.expand(i, shape) for i in tensors]

    def position(o, rg) -> list[IndexExpr]:
        reads = [i.access(o[first:first + rank], rg) for i in tensors]
        # an index below 0 counts from the end, as in eager
        wrapped = [mod(Gather(a.tensor, a.indices), x.shape[first + k], rg) for k, a in enumerate(reads)]
        return list(o[:first]) + wrapped + list(o[first + rank:])

    values = V.expand(values, loop_shape) if isinstance(values, TensorValue) else values
    writes = Writes(loop_shape, position, values)
    return reduce_into(ctx, x, writes, "sum") if accumulate else overwrite(ctx, x, writes)


MAX_MASKED_SCATTER_ROWS = 4096  # the count of earlier selected rows is a sum over earlier rows: n² work


@lowering(torch.masked_scatter, "method:masked_scatter", "method:masked_scatter_", "aten.masked_scatter",
          "aten.masked_scatter_")
def lower_masked_scatter(ctx, x, mask, source):
    """x with source's elements, in order, at the positions mask selects (a vision-language model's image features
    written over its image tokens' embeddings). Where the mask repeats along x's trailing dims (a token mask
    expanded over the hidden dim), a selected row's elements come from source at (earlier selected rows) x (row
    size) + the place in the row: the count of earlier selected rows is a sum over rows, one small node."""
    if not all(isinstance(v, TensorValue) for v in (x, mask, source)):
        raise UnsupportedOpError("masked_scatter", "arguments that are not tensors", ctx.hint)
    shape = list(ctx.shape)  # x and the mask broadcast together
    x, mask = V.expand(x, shape), V.expand(mask, shape)
    rows, before = _rows_before(ctx, mask, shape)
    row_strides, inner_strides = _strides(shape[:rows]), _strides(shape[rows:])
    row_size = math.prod(shape[rows:])
    flat_source = V.reshape(source, [math.prod(source.shape)])

    def body(o, r, rg):
        row = add(*(scale(v, s) for v, s in zip(o[:rows], row_strides)))
        place = add(*(scale(v, s) for v, s in zip(o[rows:], inner_strides)))
        count = before.access([row], rg)
        at = add(scale(Gather(count.tensor, count.indices), row_size), place)
        value = _as(flat_source.read([at], rg), source, ctx.dtype)
        return call("where", mask.read(o, rg), value, x.read(o, rg))

    return _combine(ctx, body)


@lowering("aten.masked_scatter_backward")
def lower_masked_scatter_backward(ctx, grad, mask, sizes):
    """The source's gradient: the selected elements of grad in order, then zeros (masked_select, padded to the
    source's size). The j-th selected row is found as the row with j selected rows before it."""
    shape = list(grad.shape)
    mask = V.expand(mask, shape)
    rows, before = _rows_before(ctx, mask, shape)
    n_rows, row_size = math.prod(shape[:rows]), math.prod(shape[rows:])
    row_strides = _strides(shape[:rows])

    def selected_row(o, r, rg):  # 1 + the row holding the o[0]-th selected row, 0 past the last
        coords = [mod(floordiv(r[0], s, rg), n, rg) for s, n in zip(row_strides, shape[:rows])]
        hit = call("and", _selected(mask, coords, len(shape) - rows, rg),
                   call("eq", before.read([r[0]], rg), IndexValue(o[0])))
        return call("where", hit, IndexValue(add(r[0], 1)), Const(0))

    chosen = ctx.builder.emit([n_rows], torch.int64, selected_row, reduce="sum", red_shape=[n_rows],
                              hint=f"{ctx.hint}_rows")
    flat_grad = V.reshape(grad, [math.prod(shape)])

    def body(o, r, rg):
        j, place = floordiv(o[0], row_size, rg), mod(o[0], row_size, rg)
        pick = chosen.access([j], rg)
        at = add(scale(Gather(pick.tensor, pick.indices), row_size), place, -row_size)
        found = call("and", call("lt", IndexValue(j), Const(n_rows)), call("gt", chosen.read([j], rg), Const(0)))
        return call("where", found, flat_grad.read([at], rg), _zero(ctx.dtype))

    numel = math.prod(ctx.shape)
    flat = ctx.builder.emit([numel], ctx.dtype, body, hint=ctx.hint)
    return V.reshape(flat, list(ctx.shape))


def _zero(dtype: torch.dtype) -> Const:
    return Const(0.0 if dtype.is_floating_point else False if dtype == torch.bool else 0)


def _strides(shape) -> list[int]:
    return [math.prod(shape[d + 1:]) for d in range(len(shape))]


def _selected(mask: TensorValue, row_coords, inner_rank: int, rg) -> Expr:
    return mask.read(list(row_coords) + [Lit(0)] * inner_rank, rg)


def _rows_before(ctx, mask: TensorValue, shape) -> tuple[int, TensorValue]:
    """(rows, before): the mask varies along the first `rows` dims of `shape` at most, and before[r] counts the
    selected rows ahead of row r (rows numbered row-major), a sum over rows."""
    rows = _rows_of(mask, shape)
    outer = shape[:rows]
    n_rows = math.prod(outer)
    if n_rows > MAX_MASKED_SCATTER_ROWS:
        raise UnsupportedOpError(str(ctx.node.target), f"a mask over {n_rows} rows (the count of earlier selected "
                                 f"rows is lowered for at most {MAX_MASKED_SCATTER_ROWS})", ctx.hint)
    row_strides = _strides(outer)

    def earlier(o, r, rg):
        coords = [mod(floordiv(r[0], s, rg), n, rg) for s, n in zip(row_strides, outer)]
        return call("where", call("lt", IndexValue(r[0]), IndexValue(o[0])),
                    Cast(torch.int64, _selected(mask, coords, len(shape) - rows, rg)), Const(0))

    before = ctx.builder.emit([n_rows], torch.int64, earlier, reduce="sum", red_shape=[n_rows],
                              hint=f"{ctx.hint}_rows_before")
    return rows, before


def _rows_of(mask: TensorValue, shape) -> int:
    """How many leading dims of `shape` the mask varies along at most: the dims after them it repeats along."""
    names = [f"_{d}" for d in range(len(shape))]
    ranges = dict(zip(names, shape))
    used = mask.access([Var(n) for n in names], ranges).vars
    rows = len(shape)
    while rows and names[rows - 1] not in used:
        rows -= 1
    return rows
