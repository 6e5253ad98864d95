"""Index maps with repetition and windows: repeat_interleave, tile, take_along_dim, Tensor.unfold, and the
elementwise ops that read neighbours through them (diff, cross). Views are index arithmetic on the read;
nothing is copied."""

from __future__ import annotations

import math
import operator

import torch

from ..ir.errors import ShapeError, UnsupportedOpError
from ..ir.expr import Cast, Const, IndexValue, call
from ..ir.index import add, floordiv, mod, scale
from . import values as V
from .ops_elementwise import elementwise
from .ops_shape import lower_cat, lower_repeat
from .ops_views import _remapped
from .registry import lowering, sub_ctx
from .values import TensorValue


@lowering(torch.repeat_interleave, "method:repeat_interleave", "aten.repeat_interleave")
def lower_repeat_interleave(ctx, x, repeats=None, dim=None, *, output_size=None):
    """out[.., i, ..] = x[.., i // r, ..] for a whole number of repeats r."""
    if not isinstance(x, TensorValue) or isinstance(repeats, TensorValue) or repeats is None:
        raise UnsupportedOpError("repeat_interleave", "repeats given as a tensor (a data-dependent shape)", ctx.hint)
    if dim is None:
        x, dim = V.reshape(x, [math.prod(x.shape)]), 0
    dim = V.norm_dim(dim, x.rank)
    r = int(repeats)
    shape = list(x.shape)
    shape[dim] *= r
    return _remapped(x, shape, lambda d, new, rg: floordiv(new[d], r, rg) if d == dim else new[d])


@lowering(torch.tile, "method:tile", "aten.tile")
def lower_tile(ctx, x, *dims):
    """repeat, with too few sizes counted from the last dim."""
    sizes = list(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list, torch.Size)) else list(dims)
    sizes = [1] * (x.rank - len(sizes)) + sizes
    return lower_repeat(ctx, x, *sizes)


@lowering(torch.take_along_dim, "method:take_along_dim", "aten.take_along_dim")
def lower_take_along_dim(ctx, x, indices, dim=None):
    """gather with x and the indices broadcast against each other off `dim` (or both flattened)."""
    if dim is None:
        flat = V.reshape(x, [math.prod(x.shape)])
        return V.gather_along(flat, 0, V.reshape(indices, [math.prod(indices.shape)]), wrap_negative=True)
    dim = V.norm_dim(dim, x.rank)
    if indices.rank != x.rank:
        raise ShapeError(f"take_along_dim: indices of rank {indices.rank} for a rank-{x.rank} tensor")
    off = [a if d == dim else torch.broadcast_shapes((a,), (b,))[0] for d, (a, b) in enumerate(zip(x.shape, indices.shape))]
    x_shape, i_shape = list(off), list(off)
    x_shape[dim], i_shape[dim] = x.shape[dim], indices.shape[dim]
    return V.gather_along(V.expand(x, x_shape), dim, V.expand(indices, i_shape), wrap_negative=True)


@lowering("method:unfold", "aten.unfold")
def lower_unfold(ctx, x, dimension, size, step):
    """Tensor.unfold: windows of `size` every `step` along `dimension`, the window's offset a new last dim."""
    dim = V.norm_dim(dimension, x.rank) if x.rank else 0
    count = (x.shape[dim] - size) // step + 1
    if count < 1:
        raise ShapeError(f"unfold: a window of {size} does not fit dim {dim} of size {x.shape[dim]}")
    shape = list(x.shape)
    shape[dim] = count
    shape.append(size)
    last = len(shape) - 1
    return _remapped(x, shape, lambda d, new, rg: add(scale(new[dim], step), new[last]) if d == dim else new[d])


@lowering(torch.diff, "method:diff", "aten.diff")
def lower_diff(ctx, x, n=1, dim=-1, prepend=None, append=None):
    """x[1:] - x[:-1] along dim, n times (not equal, for bool), after prepend and append are joined on; n = 0 is x
    itself, without them (as torch)."""
    dim = V.norm_dim(dim, x.rank)
    if n == 0:
        return x
    parts = [p for p in (prepend, x, append) if p is not None]
    if len(parts) > 1:
        parts = [p if isinstance(p, TensorValue) and p.rank == x.rank else _broadcast_part(ctx, p, x, dim) for p in parts]
        shape = list(x.shape)
        shape[dim] = sum(p.shape[dim] for p in parts)
        x = lower_cat(sub_ctx(ctx, shape, ctx.dtype, "joined"), parts, dim)
    op = "ne" if x.dtype == torch.bool else "sub"
    for k in range(n):
        later, earlier = V.slice_dim(x, dim, 1, None, 1), V.slice_dim(x, dim, 0, -1, 1)
        step = sub_ctx(ctx, later.shape, ctx.dtype, f"diff{k}") if k < n - 1 else ctx
        x = elementwise(step, lambda a, b: call(op, a, b), later, earlier)
    return x


def _broadcast_part(ctx, p, x: TensorValue, dim: int) -> TensorValue:
    """A 0-d tensor (or scalar) prepended or appended: one slice of x's shape along dim."""
    if not isinstance(p, TensorValue) or p.rank != 0:
        raise UnsupportedOpError("diff", "prepend or append must be a tensor of the input's rank or 0-d", ctx.hint)
    shape = list(x.shape)
    shape[dim] = 1
    return V.expand(V.reshape(p, [1] * x.rank), shape)


@lowering(torch.cross, torch.linalg.cross, "method:cross", "aten.cross", "aten.linalg_cross")
def lower_cross(ctx, a, b, dim=None):
    """out[c] = a[c+1] b[c+2] - a[c+2] b[c+1] (indices mod 3) along a dim of size 3: linalg.cross's last by
    default; torch.cross without dim takes the first of size 3."""
    shape = list(ctx.shape)
    if dim is None:
        dim = -1 if ctx.node.target is torch.linalg.cross else next((d for d, n in enumerate(shape) if n == 3), -1)
    dim = V.norm_dim(dim, len(shape))
    if shape[dim] != 3:
        raise ShapeError(f"cross: dim {dim} has size {shape[dim]}, not 3")

    def shifted(v, by):
        return _remapped(V.expand(v, shape), shape, lambda d, new, rg: mod(add(new[d], by), 3, rg) if d == dim else new[d])

    return elementwise(ctx, lambda p, q, r, s: call("sub", call("mul", p, q), call("mul", r, s)),
                       shifted(a, 1), shifted(b, 2), shifted(a, 2), shifted(b, 1))


@lowering(operator.setitem, "method:__setitem__")
def lower_setitem(ctx, x, key, value):
    """x[key] = value, as a new value of x (capture rebinds x to it; a write into a view of another tensor is
    refused there). Keys of ints, slices and an ellipsis: where(the point is selected, value at the point's
    place in the selection, x). A boolean mask over leading dims with one value for all: where(mask, value, x)."""
    if not isinstance(x, TensorValue):
        raise UnsupportedOpError("setitem", "the target is not a tensor", ctx.hint)
    tensor_keys = _tensor_keys(key)
    if tensor_keys is not None:  # x[idx] = v, x[:, rows, cols] = v: the last write to a position wins
        from .ops_scatter import lower_index_put
        return lower_index_put(ctx, x, tensor_keys, value)
    if isinstance(key, TensorValue):
        return set_masked(ctx, x, key, value)
    keys = _basic_keys(ctx, key, x.rank)
    selected = [len(range(*k.indices(n))) for k, n in zip(keys, x.shape) if isinstance(k, slice)]
    if 0 in selected:  # writes nothing (the gradient of a split's empty piece)
        return x
    if isinstance(value, TensorValue):
        value = V.expand(value, selected)

    def body(o, r, rg):
        conds, place = [], []
        for d, (k, n) in enumerate(zip(keys, x.shape)):
            at = IndexValue(o[d])
            if isinstance(k, int):
                conds.append(call("eq", at, Const(k % n)))
                continue
            start, stop, step = k.indices(n)
            length = len(range(start, stop, step))
            if (start, stop, step) == (0, n, 1):
                place.append(o[d])
                continue
            conds += [call("ge", at, Const(start)), call("lt", at, Const(stop))]
            # kept non-negative and in range where the point is not selected too: the read happens either way
            shifted = add(o[d], step * length * -(-start // (step * length)) - start)
            if step > 1:
                conds.append(call("eq", IndexValue(mod(shifted, step, rg)), Const(0)))
            place.append(mod(floordiv(shifted, step, rg), length, rg))
        new = _as(value.read(place, rg) if isinstance(value, TensorValue) else Const(value), value, ctx.dtype)
        if not conds:  # every point written (x[:] = v; a slice scatter over the whole dim, clamped)
            return new
        chosen = conds[0]
        for c in conds[1:]:
            chosen = call("and", chosen, c)
        return call("where", chosen, new, x.read(o, rg))

    return ctx.builder.emit(ctx.shape, ctx.dtype, body, hint=ctx.hint, tag=ctx.builder.new_tag("setitem"))


def set_masked(ctx, x: TensorValue, mask: TensorValue, value, accumulate: bool = False):
    """x[mask] = value (accumulate: x[mask] += value) with a boolean mask over x's leading dims and a value every
    selected element (or trailing slice) takes alike: where(mask, value, x). A value with one entry per
    selected element has as many as the mask holds Trues, which the data decides."""
    rest = x.shape[mask.rank:]
    extra = value.rank - len(rest) if isinstance(value, TensorValue) else 0
    if extra > 0 and math.prod(value.shape[:extra]) == 1:
        value = V.reshape(value, value.shape[extra:])  # x[mask] = torch.tensor([v])
    fits = not isinstance(value, TensorValue) or (value.rank <= len(rest) and all(
        v in (1, n) for v, n in zip(reversed(value.shape), reversed(rest))))
    if mask.dtype != torch.bool or tuple(x.shape[:mask.rank]) != tuple(mask.shape) or not fits:
        raise UnsupportedOpError("setitem", "a boolean mask over other than the target's leading dims, or a value "
                                 "with one entry per selected element (the count it selects depends on the data)",
                                 ctx.hint)
    for _ in rest:
        mask = V.unsqueeze(mask, mask.rank)

    def body(m, a, v):
        new = _as(call("add", a, v) if accumulate else v, value, ctx.dtype)
        return call("where", m, new, a)
    return elementwise(ctx, body, V.expand(mask, x.shape), x, value)


def _tensor_keys(key) -> list | None:
    """index_put's index list for a key of integer index tensors and whole slices (None for a whole dim);
    None for any other key."""
    keys = list(key) if isinstance(key, tuple) else [key]
    def integer_tensor(k):
        return isinstance(k, TensorValue) and k.dtype != torch.bool and not k.dtype.is_floating_point
    if not any(integer_tensor(k) for k in keys) or not all(integer_tensor(k) or k == slice(None) for k in keys):
        return None
    return [k if integer_tensor(k) else None for k in keys]


def _as(e, value, dtype: torch.dtype):
    """The value written, in the target's dtype (eager casts it on the write)."""
    source = value.dtype if isinstance(value, TensorValue) else None
    return e if source == dtype else Cast(dtype, e)


def _basic_keys(ctx, key, rank: int) -> list:
    """One int or slice per dim of the target (the ellipsis and missing trailing dims filled with full slices)."""
    keys = list(key) if isinstance(key, tuple) else [key]
    if any(k is None or not isinstance(k, (int, slice, type(Ellipsis))) for k in keys):
        raise UnsupportedOpError("setitem", "keys other than ints, slices and an ellipsis", ctx.hint)
    if sum(k is Ellipsis for k in keys) > 1:
        raise ShapeError("an index may hold only one ellipsis")
    if Ellipsis in keys:
        e = keys.index(Ellipsis)
        keys[e:e + 1] = [slice(None)] * (rank - len(keys) + 1)
    if len(keys) > rank:
        raise ShapeError(f"{len(keys)} indices for a rank-{rank} tensor")
    if any(isinstance(k, slice) and k.step is not None and k.step <= 0 for k in keys):
        raise UnsupportedOpError("setitem", "a slice with a non-positive step", ctx.hint)
    return keys + [slice(None)] * (rank - len(keys))


@lowering(torch.slice_scatter, "method:slice_scatter", "aten.slice_scatter")
def lower_slice_scatter(ctx, x, src, dim=0, start=None, end=None, step=1):
    """x with x[..., start:end:step, ...] (at `dim`) replaced by src: the gradient of a slice (RoPE's halves)."""
    dim = dim % x.rank
    return lower_setitem(ctx, x, (slice(None),) * dim + (slice(start, end, step),), src)


@lowering(torch.select_scatter, "method:select_scatter", "aten.select_scatter")
def lower_select_scatter(ctx, x, src, dim, index):
    """x with x.select(dim, index) replaced by src: the gradient of an integer index."""
    dim = dim % x.rank
    return lower_setitem(ctx, x, (slice(None),) * dim + (index,), src)
