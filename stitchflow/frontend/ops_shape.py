"""Lowerings of view, indexing, concatenation and creation ops: index arithmetic, no copies."""

from __future__ import annotations

import builtins
import math
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..ir.errors import ShapeError, UnsupportedOpError
from ..ir.expr import Const, IndexValue, call
from ..ir.index import add
from . import values as V
from .ops_complex import ComplexValue, constant, part, takes_complex
from .registry import LowerCtx, lowering, refusal
from .values import TensorValue


def _shape_args(args) -> list[int]:
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args = args[0]
    return [int(a) for a in args]


@lowering("method:view", "method:reshape", torch.reshape, "aten.view", "aten.reshape", "aten._unsafe_view")
def lower_view(ctx: LowerCtx, x: TensorValue, *shape):
    if len(shape) == 1 and isinstance(shape[0], torch.dtype):
        raise UnsupportedOpError("view(dtype)", "reinterpreting bits is not an index map", ctx.hint)
    return V.reshape(x, _shape_args(shape))


@lowering(torch.flatten, "method:flatten", "aten.flatten")
def lower_flatten(ctx, x, start_dim=0, end_dim=-1):
    return V.reshape(x, ctx.shape)


@lowering("method:unflatten", torch.unflatten, "aten.unflatten")
def lower_unflatten(ctx, x, dim, sizes):
    return V.reshape(x, ctx.shape)


@lowering("method:view_as", "method:reshape_as")
def lower_view_as(ctx, x, other):
    return V.reshape(x, ctx.shape)


@lowering(torch.permute, "method:permute", "aten.permute")
def lower_permute(ctx, x, *dims):
    return V.permute(x, _shape_args(dims))


@lowering(torch.transpose, "method:transpose", "aten.transpose", torch.swapaxes, "method:swapaxes")
def lower_transpose(ctx, x, dim0, dim1):
    return V.transpose(x, dim0, dim1)


@lowering(torch.t, "method:t", "aten.t", "aten.numpy_T")
def lower_t(ctx, x):
    return x if x.rank < 2 else V.transpose(x, 0, 1)


@lowering(torch.unsqueeze, "method:unsqueeze", "aten.unsqueeze")
def lower_unsqueeze(ctx, x, dim):
    return V.unsqueeze(x, dim)


@lowering(torch.squeeze, "method:squeeze", "aten.squeeze")
def lower_squeeze(ctx, x, dim=None):
    return V.reshape(x, ctx.shape)


@lowering("method:expand", "aten.expand", torch.broadcast_to, "method:broadcast_to")
def lower_expand(ctx, x, *shape, implicit=False):
    return V.expand(x, _shape_args(shape))


@lowering("method:expand_as")
def lower_expand_as(ctx, x, other):
    return V.expand(x, ctx.shape)


@lowering(torch.narrow, "method:narrow", "aten.narrow")
def lower_narrow(ctx, x, dim, start, length):
    if not isinstance(start, int):
        raise UnsupportedOpError("narrow", "a tensor start index makes the view data-dependent", ctx.hint)
    return V.slice_dim(x, dim, start, start + length, 1)


@lowering("aten.slice")
def lower_aten_slice(ctx, x, dim=0, start=None, end=None, step=1):
    return V.slice_dim(x, dim, start, end, step)


@lowering(torch.select, "method:select", "aten.select")
def lower_select(ctx, x, dim, index):
    return V.select(x, dim, index)


@lowering(torch.index_select, "method:index_select", "aten.index_select")
def lower_index_select(ctx, x, dim, index):
    return V.gather_dim(x, dim, _index_value(ctx, index))


@lowering(F.embedding)
def lower_embedding(ctx, index, weight, padding_idx=None, max_norm=None, *args, **kwargs):
    """weight[index]: rows gathered by the index tensor (padding_idx only changes gradients)."""
    return V.gather_dim(weight, 0, _index_value(ctx, index))


@lowering("aten.embedding")
def lower_aten_embedding(ctx, weight, index, *args, **kwargs):
    """ATen's order: the weight first (AOTAutograd's and torch.export's graphs)."""
    return V.gather_dim(weight, 0, _index_value(ctx, index))


@refusal(F.embedding)
def _embedding_with_max_norm(args, kwargs) -> str | None:
    """Refused before capture runs it: max_norm renormalises rows of the weight in place."""
    max_norm = kwargs.get("max_norm", args[3] if len(args) > 3 else None)
    return None if max_norm is None else "embedding with max_norm renormalises the weight in place"


@lowering(torch.gather, "method:gather", "aten.gather")
def lower_gather(ctx, x, dim, index, *, sparse_grad=False):
    if index.rank != x.rank:
        raise ShapeError(f"gather: the index has {index.rank} dims, the input {x.rank}")
    return V.gather_along(x, dim, _index_value(ctx, index))


@lowering(torch.chunk, "method:chunk", torch.split, "method:split", "aten.split", "aten.chunk", "aten.split_with_sizes")
def lower_split(ctx, x, sizes_or_chunks, dim=0):
    dim = V.norm_dim(dim, x.rank)
    pieces, start = [], 0
    for out in ctx.out:
        n = out.shape[dim]
        pieces.append(V.slice_dim(x, dim, start, start + n, 1))
        start += n
    return tuple(pieces)


@lowering(torch.meshgrid, torch._VF.meshgrid, "aten.meshgrid")  # (_VF: a traced call with a list)
def lower_meshgrid(ctx, *tensors, indexing=None):
    """Coordinate grids (a relative-position table's, BEiT's): grid k repeats tensor k along every other dim, a
    broadcast view. "xy" indexing swaps the first two dims (the first tensor then runs along dim 1)."""
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    if not all(isinstance(t, TensorValue) and t.rank <= 1 for t in tensors):
        raise UnsupportedOpError("meshgrid", "arguments other than 0-d and 1-d tensors", ctx.hint)
    if indexing not in (None, "ij", "xy"):
        raise UnsupportedOpError("meshgrid", f"indexing={indexing!r}", ctx.hint)
    dims = list(range(len(tensors)))
    if indexing == "xy" and len(dims) >= 2:
        dims[0], dims[1] = 1, 0  # where each tensor runs in the output
    shape = [0] * len(tensors)
    for t, d in zip(tensors, dims):
        shape[d] = math.prod(t.shape)
    grids = []
    for t, d in zip(tensors, dims):
        along = [1] * len(shape)
        along[d] = shape[d]
        grids.append(V.expand(V.reshape(t, along), shape))
    return tuple(grids)


@lowering(torch.unbind, "method:unbind", "aten.unbind")
def lower_unbind(ctx, x, dim=0):
    return tuple(V.select(x, dim, k) for k in range(x.shape[V.norm_dim(dim, x.rank)]))


def _index_value(ctx, index, size: int | None = None) -> TensorValue:
    """An index tensor as a value: a graph tensor as it is, a constant one (or a Python list of ints)
    as a parameter, its negative entries counted from the end of a dim of `size` as torch does."""
    if isinstance(index, TensorValue):
        if index.dtype == torch.bool:
            raise UnsupportedOpError("boolean-mask indexing", "the result's shape depends on the data", ctx.hint)
        held = ctx.builder.param_values.get(index.base)
        if held is not None and held.device != ctx.out.device:  # a constant such as torch.arange(n), made on the CPU
            ctx.builder.param_values[index.base] = held.to(ctx.out.device)
        return index
    if isinstance(index, (list, tuple)) and index and all(type(i) is int for i in index):
        index = torch.tensor(index, device=ctx.out.device)  # beside the tensors it indexes
    if isinstance(index, torch.Tensor) and not index.dtype.is_floating_point and index.dtype != torch.bool:
        index = index.to(ctx.out.device)  # torch indexes a CUDA tensor with CPU indices too (torch.arange(n))
        if size is not None:
            index = torch.where(index < 0, index + size, index)
        return ctx.builder.add_param("index", index)
    raise UnsupportedOpError("indexing", f"index of type {type(index).__name__}", ctx.hint)


@lowering(operator.getitem, "method:__getitem__")
def lower_getitem(ctx, x, key):
    if isinstance(x, (tuple, list)):
        return x[key]
    if not isinstance(x, TensorValue):
        return operator.getitem(x, key)
    keys = list(key) if isinstance(key, tuple) else [key]
    if builtins.sum(k is Ellipsis for k in keys) > 1:
        raise ShapeError("an index may hold only one ellipsis")
    if Ellipsis in keys:
        used = builtins.sum(k is not None and k is not Ellipsis for k in keys)
        e = keys.index(Ellipsis)
        keys[e : e + 1] = [slice(None)] * (x.rank - used)
    dim, v, gathered = 0, x, []  # gathered: (dim of v, index tensor), applied together at the end
    for k in keys:
        if k is None:
            v = V.unsqueeze(v, dim)
            dim += 1
        elif isinstance(k, int):
            v = V.select(v, dim, k)
        elif isinstance(k, slice):
            v = V.slice_dim(v, dim, k.start, k.stop, k.step)
            dim += 1
        else:
            gathered.append((dim, _index_value(ctx, k, v.shape[dim])))
            dim += 1
    if gathered:
        v = V.gather_dims(v, [d for d, _ in gathered], [i for _, i in gathered])
    if tuple(v.shape) != ctx.shape:
        raise ShapeError(f"indexing gave shape {v.shape}, torch gives {ctx.shape}")
    return v


@lowering("aten.index")
def lower_aten_index(ctx, x, indices):
    """aten.index.Tensor (exported graphs): None for a dim taken whole, else its index tensor."""
    return lower_getitem(ctx, x, tuple(slice(None) if i is None else i for i in indices))


@lowering(torch.cat, torch.concat, torch.concatenate, "aten.cat")
def lower_cat(ctx: LowerCtx, tensors, dim=0):
    """out[.., c, ..] = where(c < n0, t0[.., c, ..], where(c < n0+n1, t1[.., c-n0, ..], ...))."""
    dim = V.norm_dim(dim, len(ctx.shape))
    # torch skips empty parts (a 1-d torch.tensor([]) constant, which capture leaves a plain tensor, among them)
    parts = [t for t in tensors if not (isinstance(t, torch.Tensor) and t.numel() == 0)
             and t.rank == len(ctx.shape) and t.shape[dim] > 0]
    shape, dtype = ctx.shape, ctx.dtype

    def body(o, r, rg):
        expr, offsets, start = None, [], 0
        for t in parts:
            offsets.append(start)
            start += t.shape[dim]
        for t, off in reversed(list(zip(parts, offsets))):
            exprs = list(o)
            exprs[dim] = add(o[dim], -off)
            read = t.read(exprs, rg)
            if expr is None:
                expr = read
            else:
                cond = call("lt", IndexValue(o[dim]), Const(off + t.shape[dim]))
                expr = call("where", cond, read, expr)
        return expr

    return ctx.builder.emit(shape, dtype, body, hint=ctx.hint, tag=ctx.builder.new_tag("cat"))


@lowering(torch.stack, "aten.stack")
def lower_stack(ctx: LowerCtx, tensors, dim=0):
    """A concatenation of the inputs, each seen with a new size-1 axis at `dim`."""
    dim = V.norm_dim(dim, len(ctx.shape))
    return lower_cat(ctx, [V.unsqueeze(t, dim) for t in tensors], dim)


@lowering(
    "method:new_zeros", "method:new_ones", "method:new_full", "method:new_empty", torch.zeros_like,
    torch.ones_like, torch.full_like, torch.empty_like, "aten.zeros_like", "aten.ones_like", "aten.full_like",
    "aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.new_empty", "aten.empty_like", "aten.new_empty_strided",
    "method:new_empty_strided",
)
@takes_complex
def lower_new_constant(ctx, x, *args, **kwargs):
    """Creation ops whose value does not depend on the data: captured as constants (empty ones as zeros; the IR
    has no layouts, so new_empty_strided's strides are the backend's to restore)."""
    out = ctx.out
    if "empty" in str(ctx.node.target):
        out = torch.zeros_like(out)
    return constant(ctx.builder, out)


def lower_metadata(ctx, *args, **kwargs):
    """size(), shape, dim(), dtype...: answered from the example input (shapes are static)."""
    return ctx.out


# torch.Size(...) of sizes read so (a GAT layer's training graph): the sizes are static, so is the Size
lowering("method:size", "method:dim", "method:numel", "method:stride", builtins.getattr, "aten.sym_size",
         "aten.sym_numel", "aten.sym_stride", "aten.sym_storage_offset", torch.Size)(lower_metadata)
# arithmetic on sizes, which Dynamo records in graphs traced for dynamic shapes: numbers at capture
lowering(torch.sym_sum, torch.sym_max, torch.sym_min, torch.sym_int, torch.sym_float, torch.sym_not,
         torch.sym_ite, torch.sym_sqrt)(lower_metadata)


@lowering("method:item", "aten.item", "aten._local_scalar_dense")
def lower_item(ctx, x):
    """A graph input's (or constant's) one value as a Python number. Traced for dynamic shapes, Dynamo makes a
    module's float attributes (a norm's eps, a dropout's p) and float arguments 0-d tensor inputs and reads them
    back by item(). The number is a constant of the program: capture lists such inputs with their numbers
    (Captured.valued_inputs), a program checks them at each call, and the backend keys its programs by them.
    A number computed in the graph is refused: it depends on the data."""
    source = ctx.node.args[0] if ctx.node.args else None
    if not (isinstance(source, fx.Node) and source.op in ("placeholder", "get_attr")):
        raise UnsupportedOpError("item", "a number computed in the graph (it depends on the data)", ctx.hint)
    return ctx.out


RETURN_FIELDS = {"values": 0, "indices": 1}


@lowering(builtins.getattr)
@takes_complex
def lower_getattr(ctx, x, name):
    if name in ("real", "imag") and isinstance(x, (ComplexValue, TensorValue)):
        return part(ctx, x, name)
    if name in ("T", "mT") and isinstance(x, TensorValue):
        return V.transpose(x, -2, -1) if name == "mT" or x.rank == 2 else V.permute(x, list(reversed(range(x.rank))))
    if isinstance(x, tuple) and name in RETURN_FIELDS:  # torch.return_types: max(dim).values, .indices
        return x[RETURN_FIELDS[name]]
    field = getattr(x, name, None) if isinstance(x, tuple) and type(x) is not tuple else None
    if isinstance(field, TensorValue):  # a lowering's own torch.return_types: aminmax(x).min
        return field
    if isinstance(ctx.out, torch.Tensor):
        raise UnsupportedOpError(f"attribute .{name}", "returns a tensor that is not a view", ctx.hint)
    return ctx.out




@lowering("method:repeat", "aten.repeat")
def lower_repeat(ctx, x, *sizes):
    """out[.., c, ..] = x[.., c % n, ..]: tiling as index arithmetic."""
    sizes = _shape_args(sizes)
    v = x
    for _ in range(len(sizes) - x.rank):
        v = V.unsqueeze(v, 0)
    ranges = {f"_{d}": n for d, n in enumerate(ctx.shape)}
    old = [V.mod(V.placeholder(d), v.shape[d], ranges) for d in range(v.rank)]
    return v.remap(ctx.shape, old)

