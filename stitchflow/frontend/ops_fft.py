"""Discrete Fourier transforms of real tensors and of complex values made of them (torch.fft's fft, ifft, rfft,
irfft and their 2-d and n-d forms, torch.stft; ATen's _fft_c2c, _fft_r2c and _fft_c2r as AOTAutograd writes them):
each transformed dim is a product with the DFT's cosine and sine matrices (parameters), out[k] = sum_n x[n] ·
e^(∓2πi·kn/N), which the gpu target runs as GEMMs (FNet's authors ran its token mixing so on TPUs). O(N²) per dim
where an FFT is O(N log N): for the short dims of a model (a sequence, a hidden width, an image's side, an audio
frame) a tensor-core GEMM is the faster of the two.

A transform of length n reads the first min(n, L) entries of a dim of L (zero padding past L, truncation below it);
rfft keeps the n//2 + 1 non-negative frequencies, irfft weighs them as the Hermitian spectrum they stand for (twice,
but for the zero and Nyquist frequencies) and returns the real signal. Complex results are ComplexValues
(ops_complex.py).
"""

from __future__ import annotations

import math

import torch

from ..ir.errors import UnsupportedOpError
from ..ir.expr import Const, IndexValue, call
from ..ir.index import add, scale
from . import values as V
from .ops_complex import ComplexValue, as_complex, combine, takes_complex
from .registry import LowerCtx, lowering
from .values import TensorValue

NORMS = ("backward", "ortho", "forward")
MAX_DFT = 4096  # a transform's two matrices hold 2·N² values: 128 MiB in float32 at 4096, 2 GiB at 16384


def _scale(n: int, inverse: bool, norm: str | None, ctx: LowerCtx) -> float:
    norm = norm or "backward"
    if norm not in NORMS:
        raise UnsupportedOpError("fft", f"norm={norm!r}", ctx.hint)
    if norm == "ortho":
        return 1 / math.sqrt(n)
    return 1 / n if (norm == "backward") == inverse else 1.0


def _matrices(ctx: LowerCtx, kind: str, n: int, cols: int, dtype: torch.dtype, inverse: bool, norm):
    """(cos, ±sin) of a transform of length n over `cols` inputs, its scale folded in: e^(∓iθ) = cos ∓ i·sin, so
    the sine matrix carries the direction's sign. kind "c2c": n outputs; "r2c": the n//2 + 1 non-negative
    frequencies; "c2r": n outputs from `cols` frequencies, each weighted as its conjugate partner adds to it."""
    if n > MAX_DFT:
        raise UnsupportedOpError("fft", f"a transform of length {n}: its DFT matrices would hold 2·{n}² values "
                                        f"(taken up to {MAX_DFT}; longer ones run as torch's FFT)", ctx.hint)
    made = ctx.builder.__dict__.setdefault("dft_matrices", {})  # one pair per transform for all of a model's layers
    key = (kind, n, cols, dtype, inverse, norm)
    if key in made:
        return made[key]
    rows = n // 2 + 1 if kind == "r2c" else n
    out_at, in_at = torch.arange(rows, dtype=torch.float64), torch.arange(cols, dtype=torch.float64)
    turns = torch.outer(out_at, in_at).remainder(n)  # k·n mod N keeps the angles small
    angle = 2 * math.pi * turns / n
    weight = _scale(n, inverse, norm, ctx)
    if kind == "c2r":
        twice = torch.full((cols,), 2.0, dtype=torch.float64)
        twice[0] = 1.0
        if n % 2 == 0 and cols > n // 2:
            twice[n // 2] = 1.0
        weight = weight * twice
    cos, sin = torch.cos(angle), torch.sin(angle)
    # multiples of π/2 exactly, as FFT libraries have them: a real signal's zero and Nyquist frequencies then have
    # imaginary parts of exactly zero (their phase is 0 or π, not a rounding error's ±π)
    half, quarter = (2 * turns).remainder(n) == 0, (4 * turns).remainder(n) == 0
    cos = torch.where(half, cos.round(), torch.where(quarter, 0.0, cos))
    sin = torch.where(half, 0.0, torch.where(quarter, sin.round(), sin))
    cos, sin = cos * weight, sin * weight * (1 if inverse else -1) + 0.0  # + 0.0: no negative zeros
    made[key] = (ctx.builder.add_param(f"dft_cos{n}", cos.to(dtype)),
                 ctx.builder.add_param(f"dft_sin{n}", sin.to(dtype)))
    return made[key]


def _along(ctx: LowerCtx, matrix: TensorValue, x: TensorValue, dim: int, hint: str) -> TensorValue:
    """out[.., k, ..] = sum_n matrix[k, n] · x[.., n, ..] over the matrix's columns: one contraction (a GEMM on
    the gpu target)."""
    rows, cols = matrix.shape
    shape = list(x.shape)
    shape[dim] = rows

    def body(o, r, rg):
        at = list(o)
        at[dim] = r[0]
        return call("mul", matrix.read([o[dim], r[0]], rg), x.read(at, rg))

    return ctx.builder.emit(shape, x.dtype, body, reduce="sum", red_shape=(cols,), hint=hint)


def _transform_dim(ctx: LowerCtx, z: ComplexValue, dim: int, n: int, kind: str, inverse: bool, norm):
    """(a + ib)(C + iS) = (aC - bS) + i(aS + bC); a "c2r" transform keeps the real part alone."""
    cols = min(n // 2 + 1 if kind == "c2r" else n, z.shape[dim])
    cos, sin = _matrices(ctx, kind, n, cols, z.real.dtype, inverse, norm)
    re, im = f"{ctx.hint}_re", f"{ctx.hint}_im"
    ac = _along(ctx, cos, z.real, dim, re)
    bs = _along(ctx, sin, z.imag, dim, re) if z.imag is not None else None
    if kind == "c2r":
        return combine(ctx, "sub", ac, bs, re)
    as_ = _along(ctx, sin, z.real, dim, im)
    if z.imag is None:
        return ComplexValue(ac, as_)
    bc = _along(ctx, cos, z.imag, dim, im)
    return ComplexValue(combine(ctx, "sub", ac, bs, re), combine(ctx, "add", as_, bc, im))


def _transform(ctx: LowerCtx, x, dims, sizes, norm, inverse: bool, real: str | None = None):
    """The transform over `dims` (sizes: their lengths, None for the dims' own). real "r2c": the last dim's transform
    keeps the non-negative frequencies (done first, on the real input); "c2r": the last dim's is the real inverse
    (done last; its length defaults to 2·(L - 1))."""
    z = as_complex(ctx, x, "fft")
    dims = [V.norm_dim(d, len(z.shape)) for d in dims]
    if sizes is not None and len(sizes) != len(dims):
        raise UnsupportedOpError("fft", f"{len(sizes)} sizes for {len(dims)} dims", ctx.hint)
    lengths = [int(s) if s is not None and s != -1 else None for s in (sizes or [None] * len(dims))]
    lengths = [n if n is not None else z.shape[d] for n, d in zip(lengths[:-1], dims[:-1])] + lengths[-1:]
    if real == "r2c" and z.imag is not None:
        raise UnsupportedOpError("rfft", "a complex input", ctx.hint)
    last, n_last = dims[-1], lengths[-1]
    if real == "r2c":
        z = _transform_dim(ctx, z, last, n_last or z.shape[last], "r2c", inverse, norm)
    for d, n in reversed(list(zip(dims[:-1], lengths[:-1]))):
        z = _transform_dim(ctx, z, d, n, "c2c", inverse, norm)
    if real == "c2r":
        return _transform_dim(ctx, z, last, n_last or 2 * (z.shape[last] - 1), "c2r", inverse, norm)
    if real is None:
        z = _transform_dim(ctx, z, last, n_last or z.shape[last], "c2c", inverse, norm)
    return z


def _each_part(z: ComplexValue, fn) -> ComplexValue:
    """fn (a view, a roll) of each part of z."""
    return ComplexValue(fn(z.real), None if z.imag is None else fn(z.imag))


def _name(ctx) -> str:
    target = ctx.node.target
    return getattr(target, "__name__", str(target))


def _kind(name: str) -> tuple[bool, str | None]:
    """(inverse, real kind) from the op's name: irfft is the real inverse, rfft the real forward."""
    if "irfft" in name:
        return True, "c2r"
    if "rfft" in name:
        return False, "r2c"
    return "ifft" in name, None


@lowering(torch.fft.fft, torch.fft.ifft, torch.fft.rfft, torch.fft.irfft, "aten.fft_fft", "aten.fft_ifft",
          "aten.fft_rfft", "aten.fft_irfft")
@takes_complex
def lower_fft(ctx, x, n=None, dim=-1, norm=None, *, out=None):
    inverse, real = _kind(_name(ctx))
    return _transform(ctx, x, [dim], [n], norm, inverse, real)


@lowering(torch.fft.fft2, torch.fft.ifft2, torch.fft.fftn, torch.fft.ifftn, torch.fft.rfft2, torch.fft.irfft2,
          torch.fft.rfftn, torch.fft.irfftn, "aten.fft_fft2", "aten.fft_ifft2", "aten.fft_fftn", "aten.fft_ifftn",
          "aten.fft_rfft2", "aten.fft_irfft2", "aten.fft_rfftn", "aten.fft_irfftn")
@takes_complex
def lower_fftn(ctx, x, s=None, dim=None, norm=None, *, out=None):
    name = _name(ctx)
    if dim is None:
        dim = (-2, -1) if "2" in name else list(range(-len(s), 0)) if s is not None else list(range(len(x.shape)))
    dims = [dim] if isinstance(dim, int) else list(dim)
    inverse, real = _kind(name)
    return _transform(ctx, x, dims, None if s is None else list(s), norm, inverse, real)


def _aten_norm(normalization: int, forward: bool) -> str:
    """ATen's mode (0 none, 1 1/sqrt(n), 2 1/n) as the torch.fft norm that gives it in that direction."""
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
    return _transform(ctx, x, list(dim), None, _aten_norm(int(normalization), True), False,
                      "r2c" if onesided else None)


@lowering("aten._fft_c2r")
@takes_complex
def lower_fft_c2r(ctx, z, dim, normalization, last_dim_size):
    dims = list(dim)
    return _transform(ctx, z, dims, [None] * (len(dims) - 1) + [int(last_dim_size)],
                      _aten_norm(int(normalization), False), True, "c2r")


@lowering(torch.stft, torch.functional.stft, "aten.stft")
@takes_complex
def lower_stft(ctx, x, n_fft, hop_length=None, win_length=None, window=None, center=True, pad_mode="reflect",
               normalized=False, onesided=None, return_complex=None, align_to_window=None):
    """The short-time transform as its parts: the signal padded by n_fft // 2 at both ends (center), cut into frames
    every hop (unfold: a view), each frame times the window (centred in n_fft), each frame's transform (one-sided for
    a real signal), frequencies before frames."""
    from .ops_conv import pad
    from .ops_index import lower_unfold

    if not return_complex:
        raise UnsupportedOpError("stft", "return_complex=False (a real view of the spectrum; torch deprecates it)",
                                 ctx.hint)
    if not isinstance(x, TensorValue) or x.rank not in (1, 2) or x.dtype not in (torch.float32, torch.float64):
        raise UnsupportedOpError("stft", "a signal other than a real 1-d or 2-d float tensor", ctx.hint)
    hop, width = hop_length or n_fft // 4, win_length or n_fft
    signal = pad(ctx, x, [(n_fft // 2, n_fft // 2)], pad_mode, hint=f"{ctx.hint}_padded") if center else x
    frames = lower_unfold(ctx, signal, -1, n_fft, hop)
    if window is not None:
        left = (n_fft - width) // 2
        frames = ctx.builder.emit(frames.shape, frames.dtype, lambda o, r, rg: call("where", call(
            "and", call("ge", IndexValue(o[-1]), Const(left)), call("lt", IndexValue(o[-1]), Const(left + width))),
            call("mul", frames.read(o, rg), window.read([V.add(o[-1], -left)], rg)), Const(0.0)),
            hint=f"{ctx.hint}_windowed")
    one_sided = onesided if onesided is not None else True
    spectrum = _transform(ctx, frames, [-1], None, "ortho" if normalized else "backward", False,
                          "r2c" if one_sided else None)
    return _each_part(spectrum, lambda p: V.transpose(p, -1, -2))


@lowering(torch.fft.fftshift, torch.fft.ifftshift, "aten.fft_fftshift", "aten.fft_ifftshift")
@takes_complex
def lower_fftshift(ctx, x, dim=None):
    """The zero frequency moved to the middle (a roll by n // 2; ifftshift rolls back by -(n // 2)), each part."""
    from .ops_views import lower_roll

    rank = len(x.shape)
    dims = list(range(rank)) if dim is None else [dim] if isinstance(dim, int) else list(dim)
    sign = -1 if "ifftshift" in _name(ctx) else 1
    shifts = [sign * (x.shape[d] // 2) for d in dims]
    if not isinstance(x, ComplexValue):
        return lower_roll(ctx, x, shifts, dims)
    return _each_part(x, lambda p: lower_roll(ctx, p, shifts, dims))


@lowering(torch.istft, "aten.istft")
@takes_complex
def lower_istft(ctx, z, n_fft, hop_length=None, win_length=None, window=None, center=True, normalized=False,
                onesided=None, length=None, return_complex=False):
    """stft's inverse: each frame's inverse transform times the window, overlapped and added, divided by the
    overlapped squared window (its envelope), the centring padding cut off. The overlap-add is a sum over the frames
    that reach a sample (reads masked where a frame does not), a reduction rather than a scatter."""
    if return_complex:
        raise UnsupportedOpError("istft", "return_complex=True (a complex signal)", ctx.hint)
    spectrum = as_complex(ctx, z, "istft")
    if len(spectrum.shape) not in (2, 3):
        raise UnsupportedOpError("istft", f"a spectrum of rank {len(spectrum.shape)}", ctx.hint)
    hop, width = hop_length or n_fft // 4, win_length or n_fft
    by_frame = _each_part(spectrum, lambda p: V.transpose(p, -1, -2))
    one_sided = onesided if onesided is not None else spectrum.shape[-2] != n_fft
    norm = "ortho" if normalized else "backward"
    frames = (_transform(ctx, by_frame, [-1], [n_fft], norm, True, "c2r") if one_sided
              else _transform(ctx, by_frame, [-1], None, norm, True).real)  # (..., frames, n_fft)
    dtype, count = frames.dtype, frames.shape[-2]
    left = (n_fft - width) // 2

    def taper(offset, rg):
        """The window centred in n_fft at a frame's position `offset` (0 outside the window)."""
        at = IndexValue(offset)
        inside = call("and", call("ge", at, Const(left)), call("lt", at, Const(left + width)))
        value = window.read([add(offset, -left)], rg) if window is not None else Const(1.0)
        return call("where", inside, value, Const(0.0))

    lead = list(frames.shape[:-2])
    total = n_fft + hop * (count - 1)
    start = n_fft // 2 if center else 0
    size = length if length is not None else total - 2 * start
    if start + size > total:
        raise UnsupportedOpError("istft", f"length {length} past the {total - start} samples the frames cover",
                                 ctx.hint)

    def overlap(term, lead_vars):
        """out[..., t] = sum_f term(f, t - f·hop) over the frames f that reach sample t (of the uncut signal)."""
        def body(o, r, rg):
            offset = add(o[-1], start, scale(r[0], -hop))  # the sample's position inside frame r[0]
            at = IndexValue(offset)
            reaches = call("and", call("ge", at, Const(0)), call("lt", at, Const(n_fft)))
            return call("where", reaches, term(o[:lead_vars], r[0], offset, rg), Const(0.0))
        return body

    signal = ctx.builder.emit((*lead, size), dtype, overlap(lambda lo, f, offset, rg: call(
        "mul", frames.read([*lo, f, offset], rg), taper(offset, rg)), len(lead)), reduce="sum", red_shape=(count,),
        hint=f"{ctx.hint}_overlap")
    envelope = ctx.builder.emit((size,), dtype, overlap(lambda lo, f, offset, rg: call(
        "mul", taper(offset, rg), taper(offset, rg)), 0), reduce="sum", red_shape=(count,), hint=f"{ctx.hint}_envelope")
    return ctx.builder.emit((*lead, size), dtype, lambda o, r, rg: call(
        "div", signal.read(o, rg), envelope.read([o[-1]], rg)), hint=ctx.hint)
