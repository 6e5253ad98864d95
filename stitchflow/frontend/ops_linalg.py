"""Lowerings of contractions: matmul in all its spellings, linear, einsum, sparse mm."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from ..ir.errors import ShapeError, UnsupportedOpError
from ..ir.expr import Const, call
from ..ir.index import floordiv, mod
from . import values as V
from .ops_elementwise import elementwise
from .registry import LowerCtx, lowering
from .values import TensorValue

aten = torch.ops.aten


def _batched_read(v: TensorValue, batch_vars, batch_shape, tail, rg):
    """Read v[batch..., *tail] with v's batch dims broadcast against `batch_shape`."""
    nb = v.rank - len(tail)
    offset = len(batch_shape) - nb
    exprs = []
    for d in range(nb):
        exprs.append(batch_vars[d + offset] if v.shape[d] == batch_shape[d + offset] else V.Lit(0) if v.shape[d] == 1 else None)
        if exprs[-1] is None:
            raise ShapeError(f"batch dims of {v.shape} do not broadcast to {tuple(batch_shape)}")
    return v.read(exprs + list(tail), rg)


def contract(ctx: LowerCtx, a: TensorValue, b: TensorValue, tag=None):
    """torch.matmul semantics: 1-D operands are promoted and the added dim removed again."""
    if not isinstance(a, TensorValue) or not isinstance(b, TensorValue):
        raise UnsupportedOpError("matmul", "both operands must be tensors", ctx.hint)
    if a.rank == 0 or b.rank == 0:
        raise ShapeError("matmul of a 0-d tensor")
    a2 = V.unsqueeze(a, 0) if a.rank == 1 else a
    b2 = V.unsqueeze(b, 1) if b.rank == 1 else b
    if a2.shape[-1] != b2.shape[-2]:
        raise ShapeError(f"matmul: inner dims differ, {a.shape} @ {b.shape}")
    batch = list(torch.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]))
    out_shape = batch + [a2.shape[-2], b2.shape[-1]]
    k = a2.shape[-1]
    nbatch = len(batch)

    def body(o, r, rg):
        bv = o[:nbatch]
        i, j = o[nbatch], o[nbatch + 1]
        left = _batched_read(a2, bv, batch, [i, r[0]], rg)
        right = _batched_read(b2, bv, batch, [r[0], j], rg)
        return call("mul", left, right)

    tag = ctx.builder.new_tag(tag) if isinstance(tag, str) else tag
    out = ctx.builder.emit(out_shape, ctx.dtype, body, reduce="sum", red_shape=[k], tag=tag, hint=ctx.hint)
    if a.rank == 1:
        out = V.select(out, -2, 0)
    if b.rank == 1:
        out = V.select(out, -1, 0)
    return out


@lowering(operator.matmul, torch.matmul, torch.mm, torch.bmm, torch.sparse.mm, "method:matmul", "method:mm",
          "method:bmm", "aten.mm", "aten.bmm", "aten.matmul", "method:__matmul__", torch.spmm, "aten._sparse_mm")
def lower_matmul(ctx, a, b, *args, **kwargs):
    return contract(ctx, a, b)


@lowering(F.linear, "aten.linear")
def lower_linear(ctx, x, weight, bias=None):
    tag = ctx.builder.new_tag("linear")
    y = contract(ctx, x, V.transpose(weight, 0, 1) if weight.rank == 2 else weight, tag=tag)
    if bias is None:
        return y
    return elementwise(ctx, lambda p, q: call("add", p, q), y, bias, tag=tag, hint=f"{ctx.hint}_bias")


@lowering(torch.addmm, "aten.addmm", "method:addmm")
def lower_addmm(ctx, bias, a, b, *, beta=1, alpha=1):
    tag = ctx.builder.new_tag("linear")
    y = contract(ctx, a, b, tag=tag)
    if beta == 0:  # torch ignores the input then, NaN and inf included (torch.empty's garbage, say)
        return y if alpha == 1 else elementwise(ctx, lambda p: call("mul", p, Const(alpha)), y, tag=tag)

    def body(p, q):
        p = call("mul", p, Const(alpha)) if alpha != 1 else p
        q = call("mul", q, Const(beta)) if beta != 1 else q
        return call("add", p, q)

    return elementwise(ctx, body, y, bias, tag=tag, hint=f"{ctx.hint}_bias")


SUBSCRIPTS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # torch's labels of sublist ints 0..51


def _sublist_equation(args) -> tuple[str, tuple]:
    """einsum(a, [0, 1], b, [1, 2], [0, 2]) as ("AB,BC->AC", (a, b)); Ellipsis in a sublist is "..."."""
    def spec(sub) -> str:
        if not isinstance(sub, (list, tuple)):
            raise ShapeError(f"einsum's sublist form takes lists of subscripts, not {type(sub).__name__}")
        out = []
        for s in sub:
            if s is Ellipsis:
                out.append("...")
            elif isinstance(s, int) and 0 <= s < len(SUBSCRIPTS):
                out.append(SUBSCRIPTS[s])
            else:
                raise ShapeError(f"einsum subscript {s!r} (ints in [0, {len(SUBSCRIPTS)}) and Ellipsis)")
        return "".join(out)

    operands, specs = args[0::2], [spec(sub) for sub in args[1::2]]
    if len(args) % 2:  # an output sublist after the last operand's
        operands, out = operands[:-1], spec(args[-1])
        return ",".join(specs) + "->" + out, tuple(operands)
    return ",".join(specs), tuple(operands)


def _expand_ellipsis(specs: list[str], rhs: str | None, operands) -> tuple[list[str], str | None]:
    """Each operand's "..." as labels of its own for the dims it covers, aligned to the right across operands
    (they broadcast); an explicit output's "..." as all of them, an implicit one's first (torch's order)."""
    covered = []
    for spec, t in zip(specs, operands):
        if spec.count("...") > 1:
            raise ShapeError(f"einsum operand {spec!r} holds more than one ellipsis")
        n = t.rank - (len(spec) - 3) if "..." in spec else 0
        if n < 0:
            raise ShapeError(f"einsum operand {spec!r} has rank {t.rank}")
        covered.append(n)
    width = max(covered, default=0)
    labels = "".join(chr(0x100 + k) for k in range(width))  # outside any equation's letters
    specs = [spec.replace("...", labels[width - n:]) for spec, n in zip(specs, covered)]
    if rhs is None:
        return specs, None if width == 0 else labels + "".join(
            sorted(ch for ch in set("".join(specs)) - set(labels) if "".join(specs).count(ch) == 1))
    if rhs.count("...") > 1:
        raise ShapeError(f"einsum output {rhs!r} holds more than one ellipsis")
    return specs, rhs.replace("...", labels)


@lowering(torch.einsum, "aten.einsum")
def lower_einsum(ctx: LowerCtx, equation, *operands, path=None):
    """The equation's products summed over the labels the output lacks, in one node; also the sublist form
    (einsum(a, [0, 1], b, [1, 2], [0, 2])), an ellipsis (operands broadcast over the dims it covers) and size-1
    dims broadcast against the others, as torch."""
    if not isinstance(equation, str):
        equation, operands = _sublist_equation((equation, *operands))
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not all(isinstance(t, TensorValue) for t in operands):
        raise UnsupportedOpError("einsum", "operands that are not tensors of the graph", ctx.hint)
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    specs = lhs.split(",")
    if len(specs) != len(operands):
        raise ShapeError(f"einsum {equation!r} names {len(specs)} operands, got {len(operands)}")
    specs, rhs = _expand_ellipsis(specs, rhs if arrow else None, operands)
    letters = "".join(specs)
    if rhs is None:
        rhs = "".join(sorted(ch for ch in set(letters) if letters.count(ch) == 1))
    extent = {}
    for spec, t in zip(specs, operands):
        if len(spec) != t.rank:
            raise ShapeError(f"einsum operand {spec!r} has rank {t.rank}")
        for ch, n in zip(spec, t.shape):
            if extent.get(ch, 1) not in (1, n) and n != 1:
                raise ShapeError(f"einsum index {ch} has sizes {extent[ch]} and {n}")
            extent[ch] = max(extent.get(ch, 1), n)
    reduced = [ch for ch in dict.fromkeys(letters) if ch not in rhs]

    def body(o, r, rg):
        var = {ch: v for ch, v in zip(rhs, o)} | {ch: v for ch, v in zip(reduced, r)}
        reads = [t.read([var[ch] if t.shape[d] == extent[ch] else V.Lit(0) for d, ch in enumerate(spec)], rg)
                 for spec, t in zip(specs, operands)]
        expr = reads[0]
        for rd in reads[1:]:
            expr = call("mul", expr, rd)
        return expr

    return ctx.builder.emit(ctx.shape, ctx.dtype, body, reduce="sum" if reduced else None,
                            red_shape=[extent[ch] for ch in reduced], hint=ctx.hint)


@lowering(torch.dot, torch.vdot, torch.inner, "method:dot", "method:vdot", "method:inner", "aten.dot", "aten.vdot",
          "aten.inner")
def lower_dot(ctx, a, b):
    """Real vectors (vdot's conjugate is the identity there); inner sums the last dims of any ranks."""
    if a.dtype.is_complex or b.dtype.is_complex:
        raise UnsupportedOpError("dot", "complex tensors", ctx.hint)
    left = "abcdefgh"[:a.rank - 1] + "z"
    right = "ijklmnop"[:b.rank - 1] + "z"
    return lower_einsum(ctx, f"{left},{right}->{left[:-1]}{right[:-1]}", a, b)


@lowering(torch.mv, "method:mv", "aten.mv")
def lower_mv(ctx, a, v):
    return contract(ctx, a, v)


lowering(torch.addmv, "aten.addmv", "method:addmv")(lower_addmm)


@lowering(torch.addbmm, "aten.addbmm", "method:addbmm")
def lower_addbmm(ctx, bias, a, b, *, beta=1, alpha=1):
    """beta * bias + alpha * the sum of a batch of products."""
    y = lower_einsum(ctx, "bij,bjk->ik", a, b)
    if beta == 0:  # the input is ignored, NaN and inf included
        return elementwise(ctx, lambda p: call("mul", p, Const(alpha)), y, hint=f"{ctx.hint}_bias")
    return elementwise(ctx, lambda p, q: call("add", call("mul", p, Const(alpha)), call("mul", q, Const(beta))), y, bias,
                       hint=f"{ctx.hint}_bias")


@lowering(torch.tensordot, "aten.tensordot")
def lower_tensordot(ctx, a, b, dims=2, out=None):
    if isinstance(dims, int):
        dims = (list(range(a.rank - dims, a.rank)), list(range(dims)))
    da, db = ([dims[0]] if isinstance(dims[0], int) else list(dims[0])), ([dims[1]] if isinstance(dims[1], int) else list(dims[1]))
    if len(da) != len(db):
        raise ShapeError(f"tensordot: {len(da)} dims of a against {len(db)} of b")
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    left = [next(letters) for _ in range(a.rank)]
    right = [next(letters) for _ in range(b.rank)]
    for i, j in zip(da, db):
        right[j % b.rank] = left[i % a.rank]
    shared = set(left) & set(right)
    out = [c for c in left if c not in shared] + [c for c in right if c not in shared]
    return lower_einsum(ctx, f"{''.join(left)},{''.join(right)}->{''.join(out)}", a, b)


@lowering(torch.trace, "method:trace", "aten.trace")
def lower_trace(ctx, x):
    n = min(x.shape)
    square = V.slice_dim(V.slice_dim(x, 0, 0, n, 1), 1, 0, n, 1)
    return lower_einsum(ctx, "ii->", square)


@lowering(torch.linalg.multi_dot, torch.chain_matmul, "aten.linalg_multi_dot", "aten.chain_matmul")
def lower_multi_dot(ctx, *tensors):
    """Products left to right (multi_dot's cheapest order changes only the rounding)."""
    tensors = list(tensors[0]) if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)) else list(tensors)
    out = tensors[0]
    for t in tensors[1:]:
        out = contract(ctx, out, t)
    return out


@lowering(torch.kron, "method:kron", "aten.kron")
def lower_kron(ctx, a, b):
    """out[i * m + j] = a[i] b[j] per dim, the operand of lower rank padded with leading ones."""
    rank = len(ctx.shape)
    a = V.reshape(a, [1] * (rank - a.rank) + list(a.shape))
    b = V.reshape(b, [1] * (rank - b.rank) + list(b.shape))
    ranges = {f"_{d}": n for d, n in enumerate(ctx.shape)}
    new = [V.placeholder(d) for d in range(rank)]
    outer = a.remap(ctx.shape, [floordiv(new[d], b.shape[d], ranges) for d in range(rank)])
    inner = b.remap(ctx.shape, [mod(new[d], b.shape[d], ranges) for d in range(rank)])
    return elementwise(ctx, lambda p, q: call("mul", p, q), outer, inner)
