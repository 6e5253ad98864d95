"""Tensor values during capture: a named IR tensor seen through an index map.

Every view op (permute, reshape, expand, slicing, gathering by an index tensor) returns a new
`TensorValue` over the same base tensor with a different index map, so views cost nothing and
show up as index arithmetic on the accesses of the nodes that read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..ir.errors import ShapeError
from ..ir.expr import Access, Read
from ..ir.index import Gather, IndexExpr, Lit, Var, add, floordiv, mod, scale, substitute  # noqa: F401


def placeholder(d: int) -> Var:
    return Var(f"_{d}")


@dataclass(frozen=True)
class TensorValue:
    base: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    index: tuple[IndexExpr, ...]  # base coordinates as functions of placeholders _0.._{rank-1}

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_identity(self) -> bool:
        return self.index == tuple(placeholder(d) for d in range(self.rank))

    def ranges(self) -> dict[str, int]:
        return {f"_{d}": n for d, n in enumerate(self.shape)}

    def access(self, exprs: Sequence[IndexExpr], ranges) -> Access:
        if len(exprs) != self.rank:
            raise ShapeError(f"{len(exprs)} indices for a rank-{self.rank} value of {self.base}")
        mapping = {f"_{d}": e for d, e in enumerate(exprs)}
        return Access(self.base, tuple(substitute(i, mapping, ranges) for i in self.index))

    def read(self, exprs: Sequence[IndexExpr], ranges) -> Read:
        return Read(self.access(exprs, ranges))

    def read_broadcast(self, out_vars: Sequence[Var], out_shape: Sequence[int], ranges) -> Read:
        """Read aligned to the right of `out_vars`, size-1 dims broadcast (numpy rules)."""
        offset = len(out_shape) - self.rank
        if offset < 0:
            raise ShapeError(f"cannot broadcast shape {self.shape} to {tuple(out_shape)}")
        exprs = []
        for d, size in enumerate(self.shape):
            target = out_shape[d + offset]
            if size == target:
                exprs.append(out_vars[d + offset])
            elif size == 1:
                exprs.append(Lit(0))
            else:
                raise ShapeError(f"shapes {self.shape} and {tuple(out_shape)} do not broadcast")
        return self.read(exprs, ranges)

    def remap(self, shape: Sequence[int], old_dims: Sequence[IndexExpr]) -> "TensorValue":
        """A view of new `shape` whose old coordinate d is `old_dims[d]` over new placeholders."""
        shape = tuple(int(s) for s in shape)
        ranges = {f"_{d}": n for d, n in enumerate(shape)}
        mapping = {f"_{d}": e for d, e in enumerate(old_dims)}
        index = tuple(substitute(i, mapping, ranges) for i in self.index)
        return TensorValue(self.base, shape, self.dtype, index)


def identity(base: str, shape, dtype) -> TensorValue:
    shape = tuple(int(s) for s in shape)
    return TensorValue(base, shape, dtype, tuple(placeholder(d) for d in range(len(shape))))


def norm_dim(d: int, rank: int) -> int:
    if not -max(rank, 1) <= d < max(rank, 1):
        raise ShapeError(f"dimension {d} out of range for rank {rank}")
    return d % max(rank, 1)


# ---------------------------------------------------------------- view transforms

def permute(v: TensorValue, dims: Sequence[int]) -> TensorValue:
    dims = [norm_dim(d, v.rank) for d in dims]
    if sorted(dims) != list(range(v.rank)):
        raise ShapeError(f"permute dims {dims} are not a permutation of rank {v.rank}")
    old = [None] * v.rank
    for new_pos, old_dim in enumerate(dims):
        old[old_dim] = placeholder(new_pos)
    return v.remap([v.shape[d] for d in dims], old)


def transpose(v: TensorValue, a: int, b: int) -> TensorValue:
    dims = list(range(v.rank))
    a, b = norm_dim(a, v.rank), norm_dim(b, v.rank)
    dims[a], dims[b] = dims[b], dims[a]
    return permute(v, dims)


def expand(v: TensorValue, shape: Sequence[int]) -> TensorValue:
    shape = list(shape)
    offset = len(shape) - v.rank
    if offset < 0:
        raise ShapeError(f"cannot expand shape {v.shape} to {tuple(shape)}")
    old = []
    for d, size in enumerate(v.shape):
        target = shape[d + offset]
        if target == -1:
            shape[d + offset] = target = size
        if size == target:
            old.append(placeholder(d + offset))
        elif size == 1:
            old.append(Lit(0))
        else:
            raise ShapeError(f"cannot expand dim {d} of size {size} to {target}")
    return v.remap(shape, old)


def unsqueeze(v: TensorValue, dim: int) -> TensorValue:
    dim = norm_dim(dim, v.rank + 1)
    shape = list(v.shape)
    shape.insert(dim, 1)
    old = [placeholder(d if d < dim else d + 1) for d in range(v.rank)]
    return v.remap(shape, old)


def infer_shape(shape: Sequence[int], numel: int) -> tuple[int, ...]:
    shape = list(shape)
    if shape.count(-1) > 1:
        raise ShapeError(f"shape {shape} has more than one -1")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = numel // known if known else 0
    if math.prod(shape) != numel:
        raise ShapeError(f"cannot reshape {numel} elements to {tuple(shape)}")
    return tuple(shape)


def reshape(v: TensorValue, shape: Sequence[int]) -> TensorValue:
    """Row-major reshape as index arithmetic, simplified group by group (split: affine; merge:
    div/mod), so head splitting `(S,768) -> (S,12,64)` reads `x[s, 64*h + d]`."""
    shape = infer_shape(shape, math.prod(v.shape))
    ranges = {f"_{d}": n for d, n in enumerate(shape)}
    old: list[IndexExpr] = []
    i = j = 0
    while i < v.rank or j < len(shape):
        gi, gj = [i], [j]
        pi = v.shape[i] if i < v.rank else 1
        pj = shape[j] if j < len(shape) else 1
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(i)
                pi *= v.shape[i]
                i += 1
            else:
                gj.append(j)
                pj *= shape[j]
                j += 1
        gi = [d for d in gi if d < v.rank]
        gj = [d for d in gj if d < len(shape)]
        linear: IndexExpr = Lit(0)
        stride = 1
        for d in reversed(gj):
            linear = add(linear, scale(placeholder(d), stride))
            stride *= shape[d]
        stride = 1
        strides = {}
        for d in reversed(gi):
            strides[d] = stride
            stride *= v.shape[d]
        for d in gi:
            old.append(mod(floordiv(linear, strides[d], ranges), v.shape[d], ranges))
    return v.remap(shape, old)


def slice_dim(v: TensorValue, dim: int, start: int | None, stop: int | None, step: int | None) -> TensorValue:
    dim = norm_dim(dim, v.rank)
    start, stop, step = slice(start, stop, step).indices(v.shape[dim])
    if step <= 0:
        raise ShapeError("slices with a non-positive step are not supported")
    length = max(0, (stop - start + step - 1) // step)
    shape = list(v.shape)
    shape[dim] = length
    old = [placeholder(d) for d in range(v.rank)]
    old[dim] = add(scale(placeholder(dim), step), start)
    return v.remap(shape, old)


def select(v: TensorValue, dim: int, index: int) -> TensorValue:
    dim = norm_dim(dim, v.rank)
    index = index % v.shape[dim]
    shape = list(v.shape)
    del shape[dim]
    old = [placeholder(d if d < dim else d - 1) for d in range(v.rank)]
    old[dim] = Lit(index)
    return v.remap(shape, old)


def gather_dim(v: TensorValue, dim: int, idx: TensorValue) -> TensorValue:
    """x[..., idx, ...] along `dim` with an integer index tensor: the index tensor's dims take
    the place of `dim` (numpy advanced indexing with one index array)."""
    dim = norm_dim(dim, v.rank)
    k = idx.rank
    shape = list(v.shape[:dim]) + list(idx.shape) + list(v.shape[dim + 1:])
    idx_ranges = {f"_{d}": n for d, n in enumerate(shape)}
    idx_coords = [substitute(i, {f"_{d}": placeholder(dim + d) for d in range(k)}, idx_ranges) for i in idx.index]
    old = []
    for d in range(v.rank):
        if d < dim:
            old.append(placeholder(d))
        elif d == dim:
            old.append(Gather(idx.base, tuple(idx_coords)))
        else:
            old.append(placeholder(d - 1 + k))
    return v.remap(shape, old)


def gather_dims(v: TensorValue, dims: Sequence[int], idxs: Sequence[TensorValue]) -> TensorValue:
    """x[.., i0, .., i1, ..] with integer index tensors at `dims` (numpy advanced indexing): the
    index tensors broadcast to one shape B, whose dims take the place of the indexed dims where
    those are adjacent and lead the result where they are not (x[i, :, j] is B + x's middle dim).
    A negative index counts from the end of its dim (the gathered value is taken modulo the size)."""
    dims = list(dims)
    b = tuple(torch.broadcast_shapes(*(tuple(i.shape) for i in idxs)))
    rest = [d for d in range(v.rank) if d not in dims]
    adjacent = dims == list(range(dims[0], dims[0] + len(dims)))
    start = sum(1 for d in rest if d < dims[0]) if adjacent else 0
    shape = [v.shape[d] for d in rest]
    shape[start:start] = b
    ranges = {f"_{d}": n for d, n in enumerate(shape)}
    to_out = {f"_{e}": placeholder(start + e) for e in range(len(b))}
    old, k = [], 0
    for d in range(v.rank):
        if d in dims:
            idx = expand(idxs[dims.index(d)], b)
            gathered = Gather(idx.base, tuple(substitute(i, to_out, ranges) for i in idx.index))
            old.append(mod(gathered, v.shape[d], ranges))
        else:
            old.append(placeholder(k if k < start else k + len(b)))
            k += 1
    return v.remap(shape, old)


def gather_along(v: TensorValue, dim: int, idx: TensorValue, wrap_negative: bool = False) -> TensorValue:
    """torch.gather: out[..., j, ...] = v[..., idx[..., j, ...], ...] along `dim`, the other axes
    read at the output's own coordinates (the output has the index tensor's shape). wrap_negative:
    an index below 0 counts from the end (take_along_dim; gather refuses them)."""
    dim = norm_dim(dim, v.rank)
    shape = list(idx.shape)
    ranges = {f"_{d}": n for d, n in enumerate(shape)}
    coords = [substitute(i, {f"_{d}": placeholder(d) for d in range(idx.rank)}, ranges) for i in idx.index]
    gathered = Gather(idx.base, tuple(coords))
    along = mod(gathered, v.shape[dim], ranges) if wrap_negative else gathered
    return v.remap(shape, [along if d == dim else placeholder(d) for d in range(v.rank)])
