"""Grouped matrix products: torch._grouped_mm, F.grouped_mm and transformers' grouped_mm_fallback (a mixture of
experts' token rows, sorted by expert, each row multiplied by its expert's weight) and the fallback's backward.

`offs[e]` ends group e along the jagged dim. In index notation a position's group is a count,
group[t] = #{e : offs[e] <= t}, and the product reads the other operand at the gathered group:

    rows     (2-D a, 3-D b):  out[t, n]    = sum_k a[t, k] * b[group[t], k, n]
    columns  (3-D a, 2-D b):  out[m, n]    = sum_k a[group[n], m, k] * b[k, n]
    jagged K (2-D a, 2-D b):  out[e, m, n] = sum_s a[m, s] * b[s, n] * (group[s] == e)   (weight gradients)
    batched  (3-D a, 3-D b):  a bmm, no offsets

The gathered group is clamped to the last group and positions past offs[-1], which belong to no group (eager leaves
their rows uninitialised), are zeroed after the product. The group nodes carry the tag `grouped_mm`: the gpu target
(targets/gpu/grouped_gemm.py) reads it as the promise that groups are sorted, and runs the product as one grouped
GEMM instead of gathering an expert's weight for every row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ir.errors import ShapeError, UnsupportedOpError
from ..ir.expr import Cast, Const, IndexValue, call
from . import values as V
from .ops_linalg import contract
from .registry import LowerCtx, lowering, sub_ctx
from .values import TensorValue

GROUP_TAG = "grouped_mm"


def _group_counts(ctx: LowerCtx, offs: TensorValue, length: int, tag) -> TensorValue:
    """count[t] = #{e : offs[e] <= t}: the group of position t, or the group count past offs[-1]."""
    groups = offs.shape[0]

    def body(o, r, rg):
        return call("where", call("le", Cast(torch.int64, offs.read([r[0]], rg)), IndexValue(o[0])), Const(1), Const(0))

    return ctx.builder.emit((length,), torch.int64, body, reduce="sum", red_shape=(groups,), tag=tag,
                            hint=f"{ctx.hint}_count")


def _groups(ctx: LowerCtx, count: TensorValue, groups: int, tag) -> TensorValue:
    """The group a position's product reads: its count, clamped to the last group."""
    return ctx.builder.emit(count.shape, torch.int64,
                            lambda o, r, rg: call("min", count.read(o, rg), Const(groups - 1)),
                            tag=tag, hint=f"{ctx.hint}_group")


def _zero_past_groups(ctx: LowerCtx, out: TensorValue, count: TensorValue, dim: int, groups: int) -> TensorValue:
    """out with the positions along `dim` that no group holds (count = groups) zeroed."""
    def body(o, r, rg):
        inside = call("lt", count.read([o[dim]], rg), Const(groups))
        return call("where", inside, out.read(o, rg), Const(0.0))

    return ctx.builder.emit(out.shape, out.dtype, body, hint=f"{ctx.hint}_grouped")


def _checked(ctx: LowerCtx, a, b, offs, what: str) -> None:
    for name, v in (("mat_a", a), ("mat_b", b)):
        if not isinstance(v, TensorValue):
            raise UnsupportedOpError(what, f"{name} is not a tensor", ctx.hint)
        if v.rank not in (2, 3):
            raise ShapeError(f"{what}: {name} must be 2-D or 3-D, got shape {tuple(v.shape)}")
        if not v.dtype.is_floating_point:
            raise UnsupportedOpError(what, f"{name} of dtype {v.dtype}", ctx.hint)
    if offs is None and (a.rank, b.rank) != (3, 3):
        raise ShapeError(f"{what}: offs is required unless both operands are 3-D")
    if offs is not None:
        if not isinstance(offs, TensorValue) or offs.rank != 1 or offs.dtype not in (torch.int32, torch.int64):
            raise UnsupportedOpError(what, "offs must be a 1-D int32 tensor", ctx.hint)
        if (a.rank, b.rank) == (3, 3):
            raise ShapeError(f"{what}: offs must be None when both operands are 3-D")
    inner = a.shape[-1], b.shape[-2] if b.rank == 3 else b.shape[0]
    if inner[0] != inner[1]:
        raise ShapeError(f"{what}: inner dims differ, {tuple(a.shape)} and {tuple(b.shape)}")


def _grouped_rows(ctx: LowerCtx, a: TensorValue, b: TensorValue, offs: TensorValue, tag) -> TensorValue:
    """out[t, n] = sum_k a[t, k] * b[group[t], k, n], rows past offs[-1] zero."""
    groups = offs.shape[0]
    count = _group_counts(ctx, offs, a.shape[0], tag)
    weight = V.gather_dim(b, 0, _groups(ctx, count, groups, tag))  # [t, k, n] = b[group[t], k, n]
    out = ctx.builder.emit((a.shape[0], b.shape[2]), ctx.dtype, lambda o, r, rg: call(
        "mul", a.read([o[0], r[0]], rg), weight.read([o[0], r[0], o[1]], rg)),
        reduce="sum", red_shape=(a.shape[1],), hint=ctx.hint)
    return _zero_past_groups(ctx, out, count, 0, groups)


def grouped_mm(ctx: LowerCtx, a: TensorValue, b: TensorValue, offs: TensorValue | None, what: str) -> TensorValue:
    _checked(ctx, a, b, offs, what)
    if offs is None:
        return contract(ctx, a, b)
    groups, tag = offs.shape[0], ctx.builder.new_tag(GROUP_TAG)
    if (a.rank, b.rank) == (2, 3):
        if b.shape[0] != groups:
            raise ShapeError(f"{what}: {b.shape[0]} weights for {groups} groups")
        return _grouped_rows(ctx, a, b, offs, tag)
    if (a.rank, b.rank) == (3, 2):  # the rows form of the transposed product: outᵀ[n, m] = bᵀ[n, :] · a[group[n]]ᵀ
        if a.shape[0] != groups:
            raise ShapeError(f"{what}: {a.shape[0]} groups of mat_a for {groups} offsets")
        return V.transpose(_grouped_rows(ctx, V.transpose(b, 0, 1), V.transpose(a, 1, 2), offs, tag), 0, 1)
    count = _group_counts(ctx, offs, a.shape[1], tag)
    member = ctx.builder.emit((groups, a.shape[1]), a.dtype, lambda o, r, rg: call(
        "where", call("eq", count.read([o[1]], rg), IndexValue(o[0])), Const(1.0), Const(0.0)),
        tag=tag, hint=f"{ctx.hint}_member")
    return ctx.builder.emit((groups, a.shape[0], b.shape[1]), ctx.dtype, lambda o, r, rg: call(
        "mul", call("mul", a.read([o[1], r[0]], rg), b.read([r[0], o[2]], rg)), member.read([o[0], r[0]], rg)),
        reduce="sum", red_shape=(a.shape[1],), hint=ctx.hint)


@lowering(torch._grouped_mm, "aten._grouped_mm", *((F.grouped_mm,) if hasattr(F, "grouped_mm") else ()))
def lower_grouped_mm(ctx, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """out_dtype needs nothing: products accumulate in float32 and the result takes eager's dtype (ctx.dtype)."""
    if bias is not None:  # torch 2.11-2.13's kernels refuse it too
        raise UnsupportedOpError("grouped_mm", "a bias (its broadcast over groups is not taken yet)", ctx.hint)
    return grouped_mm(ctx, mat_a, mat_b, offs, "grouped_mm")


@lowering("aten.grouped_mm_fallback")  # transformers::grouped_mm_fallback (custom ops key by their packet's name)
def lower_transformers_grouped_mm(ctx, input, weight, offs):
    return grouped_mm(ctx, input, weight, offs, "grouped_mm_fallback")


@lowering("aten.grouped_mm_fallback_backward")
def lower_transformers_grouped_mm_backward(ctx, input, weight, offs, grad_output):
    """(grad_input, grad_weight) of transformers' grouped_mm_fallback: the rows and jagged-K forms."""
    grad_input = grouped_mm(sub_ctx(ctx, input.shape, input.dtype, "grad_input"), grad_output,
                            V.transpose(weight, 1, 2), offs, "grouped_mm_fallback_backward")
    grad_weight = grouped_mm(sub_ctx(ctx, weight.shape, weight.dtype, "grad_weight"), V.transpose(input, 0, 1),
                             grad_output, offs, "grouped_mm_fallback_backward")
    return grad_input, grad_weight
