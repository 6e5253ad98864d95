"""More index maps: roll, flip, diagonals, triangles, moved dims, pixel (un)shuffles, tensor_split, one-hot
encoding and views through explicit strides (as_strided). Each is a view (index arithmetic on the read) or one
elementwise node over coordinates."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ir.errors import ShapeError, UnsupportedOpError
from ..ir.expr import Cast, Const, IndexValue, call
from ..ir.index import Lit, add, scale
from . import values as V
from .ops_elementwise import cast
from .registry import lowering
from .values import TensorValue


def _dims_of(dims, rank: int) -> list[int]:
    dims = [dims] if isinstance(dims, int) else list(dims)
    return [V.norm_dim(d, rank) for d in dims]


def _remapped(x: TensorValue, shape, index_of) -> TensorValue:
    """A view of `shape` whose old coordinate d is index_of(d, new placeholders, ranges)."""
    ranges = {f"_{d}": n for d, n in enumerate(shape)}
    new = [V.placeholder(d) for d in range(len(shape))]
    return x.remap(shape, [index_of(d, new, ranges) for d in range(x.rank)])


@lowering(torch.roll, "method:roll", "aten.roll")
def lower_roll(ctx, x, shifts, dims=None):
    """out[i] = x[(i - shift) mod n] per rolled dim; no dims rolls the flattened tensor."""
    if dims is None or dims == []:
        flat = V.reshape(x, [math.prod(x.shape)])
        return V.reshape(lower_roll(ctx, flat, shifts, [0]), x.shape)
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = _dims_of(dims, x.rank)
    if len(shifts) != len(dims):
        raise ShapeError(f"roll: {len(shifts)} shifts for {len(dims)} dims")
    by_dim = dict(zip(dims, shifts))

    def index_of(d, new, rg):
        if d not in by_dim or x.shape[d] == 0:
            return new[d]
        n = x.shape[d]
        return V.mod(add(new[d], (-by_dim[d]) % n), n, rg)  # a non-negative offset keeps the remainder plain

    return _remapped(x, x.shape, index_of)


@lowering(torch.flip, "method:flip", "aten.flip")
def lower_flip(ctx, x, *dims_args, dims=None):
    dims = dims if dims is not None else dims_args[0] if len(dims_args) == 1 and not isinstance(dims_args[0], int) else dims_args
    dims = _dims_of(dims, x.rank)
    return _remapped(x, x.shape, lambda d, new, rg: add(scale(new[d], -1), x.shape[d] - 1) if d in dims else new[d])


@lowering(torch.fliplr, "method:fliplr")
def lower_fliplr(ctx, x):
    return lower_flip(ctx, x, [1])


@lowering(torch.flipud, "method:flipud")
def lower_flipud(ctx, x):
    return lower_flip(ctx, x, [0])


@lowering(torch.diagonal, "method:diagonal", "aten.diagonal")
def lower_diagonal(ctx, x, offset=0, dim1=0, dim2=1):
    """The dims dim1 and dim2 replaced by one last dim walking x[.., i, .., i + offset, ..]."""
    d1, d2 = V.norm_dim(dim1, x.rank), V.norm_dim(dim2, x.rank)
    if d1 == d2:
        raise ShapeError("diagonal: dim1 and dim2 are the same")
    rest = [d for d in range(x.rank) if d not in (d1, d2)]
    shape = [x.shape[d] for d in rest] + [tuple(ctx.shape)[-1]]
    last = len(shape) - 1

    def index_of(d, new, rg):
        if d == d1:
            return add(new[last], max(-offset, 0))
        if d == d2:
            return add(new[last], max(offset, 0))
        return new[rest.index(d)]

    return _remapped(x, shape, index_of)


@lowering(torch.diagonal_scatter, "method:diagonal_scatter", "aten.diagonal_scatter")
def lower_diagonal_scatter(ctx, x, src, offset=0, dim1=0, dim2=1):
    """x with the diagonal that `diagonal` takes replaced by src: a diagonal's gradient (jacrev's identity seed)."""
    d1, d2 = V.norm_dim(dim1, x.rank), V.norm_dim(dim2, x.rank)
    if d1 == d2:
        raise ShapeError("diagonal_scatter: dim1 and dim2 are the same")
    rest = [d for d in range(x.rank) if d not in (d1, d2)]
    length = max(0, min(x.shape[d1] - max(-offset, 0), x.shape[d2] - max(offset, 0)))
    if not isinstance(src, TensorValue) or tuple(src.shape) != (*(x.shape[d] for d in rest), length):
        raise ShapeError(f"diagonal_scatter: a source of shape {tuple(getattr(src, 'shape', ()))} for a diagonal of "
                         f"{length} elements")

    def body(o, r, rg):
        on = call("eq", IndexValue(o[d2]), IndexValue(add(o[d1], offset)))
        along = add(o[d1], -max(-offset, 0))  # read only where on the diagonal
        return call("where", on, src.read([o[d] for d in rest] + [along], rg), x.read(o, rg))

    return ctx.builder.emit(x.shape, x.dtype, body, hint=ctx.hint)


def _triangle(ctx, x, diagonal: int, lower: bool):
    """Zeros above (tril) or below (triu) the `diagonal`-th diagonal of the last two dims."""
    zero = Const(False) if x.dtype == torch.bool else Const(0) if not x.dtype.is_floating_point else Const(0.0)

    def body(o, r, rg):
        col, row = IndexValue(o[-1]), IndexValue(add(o[-2], diagonal))
        return call("where", call("le" if lower else "ge", col, row), x.read(o, rg), zero)

    return ctx.builder.emit(x.shape, x.dtype, body, hint=ctx.hint)


@lowering(torch.tril, "method:tril", "aten.tril")
def lower_tril(ctx, x, diagonal=0):
    return _triangle(ctx, x, diagonal, lower=True)


@lowering(torch.triu, "method:triu", "aten.triu")
def lower_triu(ctx, x, diagonal=0):
    return _triangle(ctx, x, diagonal, lower=False)


@lowering(torch.movedim, torch.moveaxis, "method:movedim", "method:moveaxis", "aten.movedim")
def lower_movedim(ctx, x, source, destination):
    src, dst = _dims_of(source, x.rank), _dims_of(destination, x.rank)
    order = [d for d in range(x.rank) if d not in src]
    for s, d in sorted(zip(dst, src)):
        order.insert(s, d)
    return V.permute(x, order)


@lowering(F.pixel_shuffle, torch.pixel_shuffle, "aten.pixel_shuffle")
def lower_pixel_shuffle(ctx, x, upscale_factor):
    """(.., C·r², H, W) -> (.., C, H·r, W·r): out[c, h, w] = x[c·r² + (h % r)·r + w % r, h // r, w // r]."""
    r, lead = upscale_factor, x.rank - 3

    def index_of(d, new, rg):
        if d < lead:
            return new[d]
        c, h, w = new[lead:]
        if d == lead:
            return add(scale(c, r * r), scale(V.mod(h, r, rg), r), V.mod(w, r, rg))
        return V.floordiv(h if d == lead + 1 else w, r, rg)

    return _remapped(x, ctx.shape, index_of)


@lowering(F.pixel_unshuffle, torch.pixel_unshuffle, "aten.pixel_unshuffle")
def lower_pixel_unshuffle(ctx, x, downscale_factor):
    """(.., C, H·r, W·r) -> (.., C·r², H, W): out[k, h, w] = x[k // r², h·r + (k // r) % r, w·r + k % r]."""
    r, lead = downscale_factor, x.rank - 3

    def index_of(d, new, rg):
        if d < lead:
            return new[d]
        k, h, w = new[lead:]
        if d == lead:
            return V.floordiv(k, r * r, rg)
        if d == lead + 1:
            return add(scale(h, r), V.mod(V.floordiv(k, r, rg), r, rg))
        return add(scale(w, r), V.mod(k, r, rg))

    return _remapped(x, ctx.shape, index_of)


@lowering(torch.tensor_split, "method:tensor_split", "aten.tensor_split")
def lower_tensor_split(ctx, x, indices_or_sections, dim=0):
    dim = V.norm_dim(dim, x.rank)
    n = x.shape[dim]
    if isinstance(indices_or_sections, int):
        k = indices_or_sections
        sizes = [n // k + (1 if s < n % k else 0) for s in range(k)]
        bounds = [sum(sizes[:s]) for s in range(k + 1)]
    else:
        bounds = [0, *[min(max(int(i), 0), n) for i in indices_or_sections], n]
    return tuple(V.slice_dim(x, dim, lo, max(lo, hi), 1) for lo, hi in zip(bounds, bounds[1:]))


@lowering(F.one_hot, torch._C._nn.one_hot, "aten.one_hot")
def lower_one_hot(ctx, t, num_classes=-1):
    """out[.., c] = (t[..] == c) as int64. Without num_classes the width is the data's maximum + 1,
    which the program cannot know for the next input: refused."""
    if num_classes < 0:
        raise UnsupportedOpError("one_hot", "num_classes=-1 makes the width depend on the data; pass it", ctx.hint)
    return ctx.builder.emit(ctx.shape, torch.int64, lambda o, r, rg: Cast(torch.int64, call(
        "eq", t.read(o[:-1], rg), IndexValue(o[-1]))), hint=ctx.hint)


def _storage_view(ctx, x: TensorValue, size, stride, storage_offset) -> TensorValue:
    """x's storage (row-major, x's own: ctx.owns_storage) seen through (size, stride, offset): element i of the
    view is storage[offset + Σ i_d · stride_d]. A row-major layout of `size` over all of x is a reshape; any other
    is the flat index unravelled over x's dims."""
    name = str(ctx.node.target).removeprefix("aten.").split(".")[0]
    if not isinstance(x, TensorValue) or not ctx.owns_storage(0):
        raise UnsupportedOpError(name, "it addresses storage, and its input is not a tensor of its own storage laid "
                                 "out row-major (a view of another, or an input of the graph)", ctx.hint)
    size, stride, offset = [int(n) for n in size], [int(s) for s in stride], int(storage_offset or 0)
    numel = math.prod(x.shape)
    if any(s < 0 for s in stride) or offset + sum((n - 1) * s for n, s in zip(size, stride)) >= numel:
        raise ShapeError(f"{name} ({ctx.hint}): size {size}, stride {stride} and offset {offset} reach past the "
                         f"{numel} elements of its input")
    if offset == 0 and math.prod(size) == numel and _row_major(size, stride):
        return V.reshape(x, size)
    flat = Lit(offset)
    for d, (n, s) in enumerate(zip(size, stride)):
        if n > 1:
            flat = add(flat, scale(V.placeholder(d), s))
    return V.reshape(x, [numel]).remap(size, [flat])


def _row_major(size, stride) -> bool:
    """Is `stride` the row-major layout of `size` (strides of size-1 dims do not matter)?"""
    expected = 1
    for n, s in reversed(list(zip(size, stride))):
        if n > 1 and s != expected:
            return False
        expected *= n
    return True


@lowering(torch.as_strided, "method:as_strided", "aten.as_strided")
def lower_as_strided(ctx, x, size, stride, storage_offset=None):
    """A view through explicit strides, as functionalization writes views it cannot name (Swin's window means)."""
    return _storage_view(ctx, x, size, stride, storage_offset)


@lowering(torch.as_strided_scatter, "aten.as_strided_scatter")
def lower_as_strided_scatter(ctx, x, src, size, stride, storage_offset=None):
    """x with its as_strided view overwritten by src (functionalization's write through such a view). Lowered where
    the view is all of x, row-major (a reshape): the result is src in x's shape; a partial view is a scatter."""
    _storage_view(ctx, x, size, stride, storage_offset)  # its legality
    if int(storage_offset or 0) or math.prod(size) != math.prod(x.shape) or not _row_major(size, stride):
        raise UnsupportedOpError("as_strided_scatter", "the view covers part of its input, or reorders it (a "
                                 "scatter)", ctx.hint)
    return cast(ctx, V.reshape(V.expand(src, [int(n) for n in size]), x.shape), ctx.dtype)


@lowering("aten.copy", "method:copy_")
def lower_copy(ctx, x, src, non_blocking=False):
    """The functional copy (and x.copy_(src), which capture rebinds): src broadcast to x's shape, in x's dtype."""
    return cast(ctx, V.expand(src, x.shape), ctx.dtype)
