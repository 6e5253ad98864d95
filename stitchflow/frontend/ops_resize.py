"""Lowerings of interpolation (F.interpolate and torch's upsample ops): nearest, linear, bilinear,
bicubic, trilinear, area, with or without align_corners and antialiasing.

Every mode is separable: the output along each spatial axis is a fixed weighted sum of a few input
positions (taps). The weights are torch's own: the op runs once at compile time on a basis (the
identity along one axis, size 1 along the others), which reads its weight matrix off exactly as
torch rounds the coordinates. Each output point is then an elementwise sum over the product of
the axes' taps, with the tap positions gathered from small index tables, so the generated kernels
fuse it with the ops around it (a feature pyramid's upsample and lateral add are one kernel).
Nearest with an integer factor is a view (x[..., h // 2, w // 2]). A NaN in the input reaches the
outputs it has weight in (torch's own kernels also pass it through taps of weight 0)."""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from ..ir.errors import UnsupportedOpError
from ..ir.expr import Const, call
from ..ir.index import Gather, Lit
from . import values as V
from .registry import LowerCtx, lowering, upcast
from .values import TensorValue

MAX_TERMS = 64  # taps per output point (product over the axes); antialiased shrinking needs more


def _weights(ctx: LowerCtx, x: TensorValue, n: int, args, kwargs) -> list[torch.Tensor]:
    """Per spatial axis, the [out, in] matrix of weights the op applies along it."""
    mats = []
    out, spatial = ctx.shape[-n:], x.shape[-n:]
    for axis in range(n):
        size = spatial[axis]
        # constant along the other axes (kept a few long, so that a factor below 1 leaves one)
        others = [size if a == axis else min(spatial[a], 64) for a in range(n)]
        basis = torch.eye(size, dtype=torch.float64).reshape(size, 1, *[size if a == axis else 1 for a in range(n)])
        y = ctx.node.target(basis.expand(size, 1, *others).contiguous(), *args, **kwargs)
        if tuple(y.shape[2 + axis: 3 + axis]) != (out[axis],):
            raise UnsupportedOpError("interpolate", "an axis resized differently on its own", ctx.hint)
        picked = y[(slice(None), 0, *[slice(None) if a == axis else 0 for a in range(n)])]  # [in, out]
        mats.append(picked.T.contiguous())
    return mats


def _taps(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The non-zero weights of each row and their columns, padded to the widest row with weight 0
    at the row's first column (so that a NaN reaches no output it has no weight in)."""
    nonzero = w != 0
    k = max(int(nonzero.sum(1).max()), 1)
    order = torch.argsort((~nonzero).to(torch.int8), dim=1, stable=True)[:, :k]
    real = torch.gather(nonzero, 1, order)
    return torch.where(real, order, order[:, :1]), torch.gather(w, 1, order) * real


def _integer_nearest(idx: torch.Tensor, w: torch.Tensor) -> int | None:
    """s when the taps are exactly x[o // s] with weight 1."""
    if idx.shape[1] != 1 or not bool((w == 1).all()):
        return None
    out = idx.shape[0]
    for s in range(1, out + 1):
        if out % s == 0 and torch.equal(idx[:, 0], torch.arange(out) // s):
            return s
    return None


def resize(ctx: LowerCtx, x: TensorValue, n: int, args, kwargs) -> TensorValue:
    if x.rank < n + 1:
        raise UnsupportedOpError("interpolate", f"input of rank {x.rank} for {n} spatial axes", ctx.hint)
    taps = [_taps(w) for w in _weights(ctx, x, n, args, kwargs)]
    lead, shape = x.rank - n, list(ctx.shape)
    steps = [_integer_nearest(idx, w) for idx, w in taps]
    if all(s is not None for s in steps):  # a view: no node at all
        ranges = {f"_{d}": size for d, size in enumerate(shape)}
        coords = [V.placeholder(d) for d in range(lead)] + [
            V.floordiv(V.placeholder(lead + a), s, ranges) for a, s in enumerate(steps)]
        return x.remap(shape, coords)
    terms = math.prod(idx.shape[1] for idx, _ in taps)
    if terms > MAX_TERMS:
        raise UnsupportedOpError("interpolate", f"{terms} taps per output point (at most {MAX_TERMS} are lowered)",
                                 ctx.hint)
    device = ctx.out.device
    tables = [(ctx.builder.add_param("resize_taps", idx.to(device)),
               ctx.builder.add_param("resize_weights", w.to(device=device, dtype=torch.float32))) for idx, w in taps]

    def body(o, r, rg):
        total = None
        for combo in itertools.product(*(range(idx.shape[1]) for idx, _ in taps)):
            index = list(o[:lead]) + [Gather(t.base, (o[lead + a], Lit(k))) for a, ((t, _), k) in
                                      enumerate(zip(tables, combo))]
            term = upcast(x.read(index, rg), x)
            for a, ((_, wt), k) in enumerate(zip(tables, combo)):
                term = call("mul", term, wt.read([o[lead + a], Lit(k)], rg))
            total = term if total is None else call("add", total, term)
        return total if total is not None else Const(0.0)

    return ctx.builder.emit(shape, ctx.dtype, body, hint=ctx.hint)


@lowering(F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear, "aten.upsample_nearest1d",
          "aten.upsample_nearest2d", "aten.upsample_nearest3d", "aten.upsample_linear1d", "aten.upsample_bilinear2d",
          "aten.upsample_bicubic2d", "aten.upsample_trilinear3d", "aten._upsample_nearest_exact1d",
          "aten._upsample_nearest_exact2d", "aten._upsample_nearest_exact3d", "aten._upsample_bilinear2d_aa",
          "aten._upsample_bicubic2d_aa")
def lower_interpolate(ctx, x, *args, **kwargs):
    n = x.rank - 2
    if n < 1 or len(ctx.shape) != x.rank:
        raise UnsupportedOpError("interpolate", f"input of rank {x.rank}", ctx.hint)
    return resize(ctx, x, n, args, kwargs)


for _name in ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
              "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_nearest_exact1d",
              "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "_upsample_bilinear2d_aa",
              "_upsample_bicubic2d_aa"):
    if hasattr(torch._C._nn, _name):  # what Dynamo records when it inlines F.interpolate
        lowering(getattr(torch._C._nn, _name))(lower_interpolate)
