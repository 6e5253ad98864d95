"""Discrete Fourier transforms of real tensors (torch.fft.fft, fft2, fftn and their inverses), as FNet mixes tokens:
each transformed dim is a product with the DFT's cosine and sine matrices (parameters), out[k] = sum_n x[n] ·
e^(∓2πi·kn/N), which the gpu target runs as GEMMs (FNet's authors ran it so on TPUs). O(N²) per dim where an FFT is
O(N log N): for the short dims of a model (a sequence, a hidden width) a tensor-core GEMM is the faster of the two.

The IR is real, so a complex result lives in the frontend only, as a ComplexValue of its two parts; `.real`,
`.imag`, torch.real / torch.imag and view_as_real take it back to tensors, and any other op that meets it is refused
with that reason (capture checks `takes_complex`). Inputs are real float32 or float64; `n` / `s` other than the dims'
own sizes (zero padding, truncation) are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ir.errors import UnsupportedOpError
from ..ir.expr import Const, IndexValue, call
from . import values as V
from .registry import LowerCtx, lowering
from .values import TensorValue

NORMS = ("backward", "ortho", "forward")


@dataclass(frozen=True)
class ComplexValue:
    """A complex tensor as its real and imaginary parts; `imag` None is zero (a real tensor's transform input)."""

    real: TensorValue
    imag: TensorValue | None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.real.shape


def takes_complex(fn):
    """Marks a lowering that accepts ComplexValue arguments (capture refuses them for every other)."""
    fn.takes_complex = True
    return fn


def _dft_matrices(ctx: LowerCtx, n: int, dtype: torch.dtype, inverse: bool, norm: str | None):
    """(cos, ±sin) matrices of the transform along a dim of n, its normalisation folded in: the forward transform
    multiplies by cos - i·sin, the inverse by cos + i·sin."""
    norm = norm or "backward"
    if norm not in NORMS:
        raise UnsupportedOpError("fft", f"norm={norm!r}", ctx.hint)
    made = ctx.builder.__dict__.setdefault("dft_matrices", {})  # one pair per size for all of a model's layers
    key = (n, dtype, inverse, norm)
    if key in made:
        return made[key]
    scaled = {"backward": inverse, "forward": not inverse}.get(norm)
    scale = 1 / math.sqrt(n) if norm == "ortho" else (1 / n if scaled else 1.0)
    k = torch.arange(n, dtype=torch.float64)
    angle = 2 * math.pi * torch.outer(k, k).remainder(n) / n  # k·n mod N keeps the angles small and exact
    cos, sin = torch.cos(angle) * scale, torch.sin(angle) * scale * (1 if inverse else -1)
    made[key] = (ctx.builder.add_param(f"dft_cos{n}", cos.to(dtype)), ctx.builder.add_param(f"dft_sin{n}", sin.to(dtype)))
    return made[key]


def _along(ctx: LowerCtx, matrix: TensorValue, x: TensorValue, dim: int, hint: str) -> TensorValue:
    """out[.., k, ..] = sum_n matrix[k, n] · x[.., n, ..]: one contraction (a GEMM on the gpu target)."""
    def body(o, r, rg):
        at = list(o)
        at[dim] = r[0]
        return call("mul", matrix.read([o[dim], r[0]], rg), x.read(at, rg))

    return ctx.builder.emit(x.shape, x.dtype, body, reduce="sum", red_shape=(x.shape[dim],), hint=hint)


def _combine(ctx: LowerCtx, op: str, a: TensorValue, b: TensorValue, hint: str) -> TensorValue:
    return ctx.builder.emit(a.shape, a.dtype, lambda o, r, rg: call(op, a.read(o, rg), b.read(o, rg)), hint=hint)


def _transform_dim(ctx: LowerCtx, z: ComplexValue, dim: int, inverse: bool, norm) -> ComplexValue:
    """(a + ib)(C + iS) = (aC - bS) + i(aS + bC), with S the sign-carrying sine matrix."""
    cos, sin = _dft_matrices(ctx, z.shape[dim], z.real.dtype, inverse, norm)
    ac, as_ = _along(ctx, cos, z.real, dim, f"{ctx.hint}_re"), _along(ctx, sin, z.real, dim, f"{ctx.hint}_im")
    if z.imag is None:
        return ComplexValue(ac, as_)
    bc, bs = _along(ctx, cos, z.imag, dim, f"{ctx.hint}_re"), _along(ctx, sin, z.imag, dim, f"{ctx.hint}_im")
    return ComplexValue(_combine(ctx, "sub", ac, bs, f"{ctx.hint}_re"), _combine(ctx, "add", as_, bc, f"{ctx.hint}_im"))


def _transform(ctx: LowerCtx, x, dims, sizes, norm, inverse: bool) -> ComplexValue:
    if isinstance(x, ComplexValue):
        z = x
    elif isinstance(x, TensorValue) and x.dtype in (torch.float32, torch.float64):
        z = ComplexValue(x, None)
    else:
        raise UnsupportedOpError("fft", f"an input of {getattr(x, 'dtype', type(x).__name__)} (real float32 or "
                                        "float64 tensors are taken)", ctx.hint)
    dims = [V.norm_dim(d, len(z.shape)) for d in dims]
    if sizes is not None and [int(s) for s in sizes] != [z.shape[d] for d in dims]:
        raise UnsupportedOpError("fft", f"sizes {list(sizes)} other than the dims' own (zero padding or truncation)",
                                 ctx.hint)
    for d in reversed(dims):
        z = _transform_dim(ctx, z, d, inverse, norm)
    return z


def _dims(x, dim) -> list[int]:
    rank = len(x.shape)
    return list(range(rank)) if dim is None else [dim] if isinstance(dim, int) else list(dim)


def _name(ctx) -> str:
    target = ctx.node.target
    return getattr(target, "__name__", str(target))


@lowering(torch.fft.fft, torch.fft.ifft, "aten.fft_fft", "aten.fft_ifft")
@takes_complex
def lower_fft(ctx, x, n=None, dim=-1, norm=None, *, out=None):
    return _transform(ctx, x, [dim], None if n is None else [n], norm, "ifft" in _name(ctx))


@lowering(torch.fft.fft2, torch.fft.ifft2, torch.fft.fftn, torch.fft.ifftn, "aten.fft_fft2", "aten.fft_ifft2",
          "aten.fft_fftn", "aten.fft_ifftn")
@takes_complex
def lower_fftn(ctx, x, s=None, dim=None, norm=None, *, out=None):
    name = _name(ctx)
    if dim is None and "2" in name:
        dim = (-2, -1)
    return _transform(ctx, x, _dims(x, dim if dim is not None or s is None else list(range(-len(s), 0))), s, norm,
                      "ifft" in name)




def _aten_norm(normalization: int, forward: bool) -> str:
    """ATen's mode as the torch.fft norm that gives it: 2 (1/n) is "forward" going forward, "backward" inverted."""
    if normalization == 2:
        return "forward" if forward else "backward"
    if normalization == 1:
        return "ortho"
    return "backward" if forward else "forward"


@lowering("aten._fft_c2c")
@takes_complex
def lower_fft_c2c(ctx, z, dim, normalization, forward):
    """AOTAutograd's transform of a complex tensor (a real one made complex first, `_to_copy`)."""
    return _transform(ctx, z, list(dim), None, _aten_norm(int(normalization), bool(forward)), not forward)


@lowering("aten._fft_r2c")
@takes_complex
def lower_fft_r2c(ctx, x, dim, normalization, onesided):
    if onesided:
        raise UnsupportedOpError("_fft_r2c", "a one-sided (rfft) spectrum", ctx.hint)
    return _transform(ctx, x, list(dim), None, _aten_norm(int(normalization), True), False)


@lowering(torch.view_as_complex, "aten.view_as_complex")
@takes_complex
def lower_view_as_complex(ctx, t):
    """t[..., 0] + i·t[..., 1] (a gradient made complex for the transform's backward)."""
    if not isinstance(t, TensorValue) or t.shape[-1] != 2:
        raise UnsupportedOpError("view_as_complex", "a tensor whose last dim is not 2", ctx.hint)
    return ComplexValue(V.select(t, -1, 0), V.select(t, -1, 1))


def part(ctx, z, name: str):
    """z.real or z.imag (builtins.getattr's lowering asks too)."""
    if isinstance(z, TensorValue):  # .real of a real tensor is the tensor; its .imag is refused by torch itself
        return z
    if not isinstance(z, ComplexValue):
        raise UnsupportedOpError(f".{name}", f"of a {type(z).__name__}", ctx.hint)
    part = z.real if name == "real" else z.imag
    if part is None:
        return ctx.builder.emit(z.shape, z.real.dtype, lambda o, r, rg: Const(0.0), hint=ctx.hint)
    return part


@lowering(torch.real, "aten.real")
@takes_complex
def lower_real(ctx, z):
    return part(ctx, z, "real")


@lowering(torch.imag, "aten.imag")
@takes_complex
def lower_imag(ctx, z):
    return part(ctx, z, "imag")


@lowering(torch.view_as_real, "aten.view_as_real")
@takes_complex
def lower_view_as_real(ctx, z):
    """out[..., 0] = real, out[..., 1] = imag."""
    if not isinstance(z, ComplexValue):
        raise UnsupportedOpError("view_as_real", f"of a {type(z).__name__}", ctx.hint)
    real, imag = part(ctx, z, "real"), part(ctx, z, "imag")
    return ctx.builder.emit((*z.shape, 2), z.real.dtype, lambda o, r, rg: call(
        "where", call("eq", IndexValue(o[-1]), Const(0)), real.read(o[:-1], rg), imag.read(o[:-1], rg)),
        hint=ctx.hint)
