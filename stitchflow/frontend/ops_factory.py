"""Tensors a model makes from nothing (torch.zeros, full, arange, eye, linspace, tensor...): computed where they are
used, not stored. Shapes are static, so the eager result at capture says what each one holds; a lowering
writes that as a formula of the coordinates (a constant, an affine iota, a diagonal) after checking the
formula gives exactly those values, and otherwise captures the values as a constant input."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..ir.errors import UnsupportedOpError
from ..ir.expr import Cast, Const, IndexValue, call
from ..ir.index import add, scale
from .ops_complex import ComplexValue, constant, takes_complex
from .ops_elementwise import cast
from .registry import LowerCtx, describe_target, factory
from .values import TensorValue

# integers past 2^24 are not all floats: an iota cast to float32 beyond it would round where eager's does not
EXACT_FLOAT_IOTA = 2 ** 24


def _constant_input(ctx: LowerCtx):
    return constant(ctx.builder, ctx.out)


def _literal(value, dtype: torch.dtype) -> Const:
    if dtype == torch.bool:
        return Const(bool(value))
    return Const(float(value)) if dtype.is_floating_point else Const(int(value))


def _filled(ctx: LowerCtx, value):
    return ctx.builder.emit(ctx.shape, ctx.dtype, lambda o, r, rg: _literal(value, ctx.dtype), hint=ctx.hint,
                            tag=ctx.builder.new_tag("full"))


@factory(torch.zeros, torch.ones, torch.full, torch.empty, "aten.zeros", "aten.ones", "aten.full", "aten.empty",
          "aten.scalar_tensor", torch.scalar_tensor, torch.empty_strided, "aten.empty_strided", torch.empty_permuted,
          "aten.empty_permuted")
@takes_complex
def lower_filled(ctx: LowerCtx, *args, **kwargs):
    """One value everywhere; `empty` (strided or permuted: the IR has no layouts, and the backend hands an output
    that eager ops read over in eager's strides) holds whatever was there, taken to be zeros (as `empty_like`)."""
    out = ctx.out
    if out.dtype.is_complex and not bool(out.any()) or "empty" in str(ctx.node.target) and out.dtype.is_complex:
        real = ctx.out.dtype.to_real()  # zeros: a real part of zeros, no imaginary part
        return ComplexValue(_filled(LowerCtx(ctx.builder, ctx.node, torch.empty(out.shape, dtype=real,
                                                                                  device="meta")), 0), None)
    if "empty" in str(ctx.node.target) or out.numel() == 0:
        return _filled(ctx, 0)
    first = out.reshape(-1)[0]
    if out.dtype.is_complex or not bool((out == first).all()):
        return _constant_input(ctx)
    return _filled(ctx, first.item())


@factory(torch.arange, "aten.arange")
def lower_arange(ctx: LowerCtx, *args, **kwargs):
    """start + step * i: exact in integers and in floats with whole start and step below 2^24; a fractional
    step's values are captured (eager computes them in double precision, which float32 arithmetic would not
    match to the bit)."""
    out = ctx.out
    n = out.numel()
    start = out[0].item() if n else 0
    step = (out[1] - out[0]).item() if n > 1 else 1
    whole = float(start).is_integer() and float(step).is_integer()
    in_range = not out.dtype.is_floating_point or max(abs(start), abs(start + step * (n - 1))) < EXACT_FLOAT_IOTA
    if n == 0 or out.dtype.is_complex or out.dtype == torch.bool or not (whole and in_range):
        return _constant_input(ctx)
    expected = (torch.arange(n, dtype=torch.int64) * int(step) + int(start)).to(out.dtype)
    if not torch.equal(expected, out.cpu()):
        return _constant_input(ctx)

    def body(o, r, rg):
        return Cast(ctx.dtype, IndexValue(add(scale(o[0], int(step)), int(start))))

    return ctx.builder.emit(ctx.shape, ctx.dtype, body, hint=ctx.hint, tag=ctx.builder.new_tag("arange"))


@factory(torch.eye, "aten.eye")
def lower_eye(ctx: LowerCtx, *args, **kwargs):
    one, zero = _literal(1, ctx.dtype), _literal(0, ctx.dtype)

    def body(o, r, rg):
        return call("where", call("eq", IndexValue(o[0]), IndexValue(o[1])), one, zero)

    return ctx.builder.emit(ctx.shape, ctx.dtype, body, hint=ctx.hint, tag=ctx.builder.new_tag("eye"))


@factory(torch.linspace, torch.logspace, "aten.linspace", "aten.logspace")
def lower_spaced(ctx: LowerCtx, *args, **kwargs):
    """Eager computes these from both ends (for symmetry), which a formula here would not match to the bit."""
    return _constant_input(ctx)


MAX_ENTRIES = 256  # torch.tensor([a, b, ...]) of graph scalars: one select per entry at every point


@factory(torch.tensor, torch.as_tensor, torch.asarray, torch._refs.tensor)  # Dynamo: torch.tensor([t, ...])
def lower_tensor(ctx: LowerCtx, data, *args, **kwargs):
    """A tensor the model writes out (x * torch.tensor(2.0), x + torch.tensor([1., 2., 3.])): one value
    everywhere is a formula (`full`), others a captured constant. Given a tensor of the graph, a copy of it in
    the result's dtype (torch.tensor(x) copies; as_tensor and asarray may share it, which a value of the IR
    does as well); given (nested) lists holding 0-d tensors of the graph, each entry selected by its position."""
    if isinstance(data, TensorValue):
        return cast(ctx, data, ctx.dtype)
    held = []
    fx.node.map_aggregate(data, lambda a: held.append(a) if isinstance(a, TensorValue) else a)
    if not held:
        return lower_filled(ctx)
    if any(t.rank for t in held) or ctx.out.numel() > MAX_ENTRIES:
        raise UnsupportedOpError(describe_target(ctx.node), f"data holding tensors of the graph other than up to "
                                 f"{MAX_ENTRIES} 0-d ones (torch.stack them instead)", ctx.hint)

    def entry(d, o, rg, depth: int):
        if isinstance(d, TensorValue):
            return d.read([], rg) if d.dtype == ctx.dtype else Cast(ctx.dtype, d.read([], rg))
        if not isinstance(d, (list, tuple)):
            return _literal(d, ctx.dtype)
        parts = [entry(e, o, rg, depth + 1) for e in d]
        e = parts[-1]
        for k in reversed(range(len(parts) - 1)):
            e = call("where", call("eq", IndexValue(o[depth]), Const(k)), parts[k], e)
        return e

    return ctx.builder.emit(ctx.shape, ctx.dtype, lambda o, r, rg: entry(data, o, rg, 0), hint=ctx.hint)


@factory(torch.hann_window, torch.hamming_window, torch.blackman_window, torch.bartlett_window, torch.kaiser_window,
         "aten.hann_window", "aten.hamming_window", "aten.blackman_window", "aten.bartlett_window",
         "aten.kaiser_window")
def lower_window(ctx: LowerCtx, *args, **kwargs):
    """A spectral window (an stft's): a constant of the program."""
    return _constant_input(ctx)
