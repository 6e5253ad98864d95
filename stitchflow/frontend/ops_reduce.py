"""Lowerings of reductions and of the composite ops built from them (softmax, norms). Scatters (reductions
into computed positions) are in ops_scatter."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ir.errors import UnsupportedOpError
from ..ir.expr import Cast, Const, IndexValue, call
from ..ir.graph import Tag
from . import values as V
from .ops_elementwise import cast
from .registry import LowerCtx, compute_dtype, lowering, refusal, upcast
from .values import TensorValue


def _dims(dim, rank) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(rank))
    dims = sorted({V.norm_dim(d, rank) for d in ([dim] if isinstance(dim, int) else list(dim))})
    return dims if rank else []  # a 0-d tensor's dim 0 (or -1) is the tensor itself


def reduce(ctx: LowerCtx, x: TensorValue, dims, kind: str, *, keepdim=False, scale=None, dtype=None,
           pre=None, tag: Tag | None = None, hint=None) -> TensorValue:
    """out = kind_{dims} pre(x) * scale; kept dims become size-1 output dims when keepdim."""
    dims = _dims(dims, x.rank)
    out_shape = [1 if d in dims else n for d, n in enumerate(x.shape) if keepdim or d not in dims]
    red_shape = [x.shape[d] for d in dims]
    dtype = dtype or x.dtype

    def body(o, r, rg):
        exprs, oi, ri = [], 0, 0
        for d in range(x.rank):
            if d in dims:
                exprs.append(r[ri])
                ri += 1
                oi += keepdim
            else:
                exprs.append(o[oi])
                oi += 1
        e = upcast(x.read(exprs, rg), x)
        e = pre(e, o) if pre else e
        return call("mul", e, Const(scale)) if scale is not None else e

    # nothing to reduce (a 0-d tensor's dim 0): each output point is its own element
    return ctx.builder.emit(out_shape, dtype, body, reduce=kind if dims else None, red_shape=red_shape, tag=tag,
                            hint=hint or ctx.hint)


def _widened(ctx, x):
    """The reduction's operand cast to its result type first, as torch does for sum(x, dtype=float64) (and
    for integers summed as int64): accumulating in x's type would round each partial sum to it."""
    return None if x.dtype == ctx.dtype else (lambda e, o: Cast(ctx.dtype, e))


@lowering(torch.sum, "method:sum", "aten.sum")
def lower_sum(ctx, x, dim=None, keepdim=False, *, dtype=None):
    return reduce(ctx, x, dim, "sum", keepdim=keepdim, dtype=ctx.dtype, pre=_widened(ctx, x))


@lowering(torch.mean, "method:mean", "aten.mean")
def lower_mean(ctx, x, dim=None, keepdim=False, *, dtype=None):
    count = math.prod(x.shape[d] for d in _dims(dim, x.rank))
    return reduce(ctx, x, dim, "sum", keepdim=keepdim, scale=1.0 / count, dtype=ctx.dtype, pre=_widened(ctx, x))


@lowering(torch.amax, "method:amax", "aten.amax")
def lower_amax(ctx, x, dim=(), keepdim=False):
    return reduce(ctx, x, dim, "max", keepdim=keepdim, dtype=ctx.dtype)


@lowering(torch.max, "method:max", "aten.max")
def lower_max(ctx, x, dim=None, keepdim=False):
    if isinstance(dim, TensorValue):
        return _pointwise(ctx, "max", x, dim)
    if dim is not None:
        return extreme_and_index(ctx, x, dim, keepdim, "max")
    return reduce(ctx, x, None, "max", dtype=ctx.dtype)


@lowering(torch.min, "method:min", "aten.min")
def lower_min(ctx, x, dim=None, keepdim=False):
    if isinstance(dim, TensorValue):
        return _pointwise(ctx, "min", x, dim)
    if dim is not None:
        return extreme_and_index(ctx, x, dim, keepdim, "min")
    return lower_amin(ctx, x)


@lowering(torch.argmax, "method:argmax", "aten.argmax")
def lower_argmax(ctx, x, dim=None, keepdim=False):
    return _argument(ctx, x, dim, keepdim, "max")


@lowering(torch.argmin, "method:argmin", "aten.argmin")
def lower_argmin(ctx, x, dim=None, keepdim=False):
    return _argument(ctx, x, dim, keepdim, "min")


def _argument(ctx, x, dim, keepdim, kind):
    if dim is None:
        if x.rank > 1:
            raise UnsupportedOpError(f"arg{kind}", "without dim it indexes the flattened tensor; give a dim", ctx.hint)
        dim = 0
    return extreme_and_index(ctx, x, dim, keepdim, kind)[1]


MAX_INDEXED = 1 << 24  # positions are compared as float32, exact up to here


def extreme_and_index(ctx, x, dim, keepdim, kind):
    """(values, indices) of max or min over `dim`: the extreme, then the first position holding
    it, found as max_k where(x[k] == extreme, -k, -n) in float32 (the IR reduces by sum and max
    only; a NaN counts as the extreme, as torch returns it and its first index)."""
    dim = V.norm_dim(dim, x.rank)
    n = x.shape[dim]
    if n >= MAX_INDEXED:
        raise UnsupportedOpError(f"{kind}(dim)", f"{n} positions along dim {dim} (indices are found in float32)",
                                 ctx.hint)
    tag = ctx.builder.new_tag(f"{kind}_index")
    acc = compute_dtype(x.dtype)
    signed = (lambda e: e) if kind == "max" else _flip(x.dtype)
    peak = reduce(ctx, x, [dim], "max", pre=lambda e, o: signed(e), dtype=acc, tag=tag, hint=f"{ctx.hint}_peak")
    shape = [1 if d == dim else size for d, size in enumerate(x.shape) if keepdim or d != dim]
    outer = (lambda o: [o[d] for d in range(len(o)) if d != dim]) if keepdim else (lambda o: list(o))

    def first_at_peak(o, r, rg):
        rest = outer(o)
        v = signed(upcast(x.read(rest[:dim] + [r[0]] + rest[dim:], rg), x))
        hit = call("or", call("eq", v, peak.read(rest, rg)), call("ne", v, v))
        return call("where", hit, call("neg", Cast(torch.float32, IndexValue(r[0]))), Const(float(-n)))

    b = ctx.builder
    first = b.emit(shape, torch.float32, first_at_peak, reduce="max", red_shape=[n], tag=tag, hint=f"{ctx.hint}_first")
    index = b.emit(shape, torch.int64, lambda o, r, rg: Cast(torch.int64, call("neg", first.read(o, rg))), tag=tag,
                   hint=f"{ctx.hint}_index")
    values = b.emit(shape, x.dtype, lambda o, r, rg: signed(peak.read(outer(o), rg)), tag=tag, hint=ctx.hint)
    return values, index


@lowering(torch.amin, "method:amin", "aten.amin")
def lower_amin(ctx, x, dim=(), keepdim=False):
    """min = -max(-x): the IR reduces by sum and max only."""
    tag, flip = ctx.builder.new_tag("amin"), _flip(x.dtype)
    peak = reduce(ctx, x, dim, "max", keepdim=keepdim, dtype=ctx.dtype, pre=lambda e, o: flip(e), tag=tag,
                  hint=f"{ctx.hint}_negmax")
    return ctx.builder.emit(peak.shape, ctx.dtype, lambda o, r, rg: flip(peak.read(o, rg)), tag=tag,
                            hint=ctx.hint)


def _flip(dtype: torch.dtype):
    """An order-reversing involution of `dtype`'s values, so that min is flip(max(flip(x))): negation, or
    for unsigned integers (where -x wraps: uint8's min of [0, 5, 200] came out 5) largest - x, for bools not."""
    if dtype == torch.bool:
        return lambda e: call("not", e)
    if dtype == torch.uint8:
        top = Const(torch.iinfo(dtype).max)
        return lambda e: call("sub", top, e)
    return lambda e: call("neg", e)


def _correction_args(args, kwargs) -> tuple:
    """(dim, correction, keepdim) of var/std in any of torch's spellings: var(x, dim, unbiased,
    keepdim), var(x, unbiased), var(x, dim, *, correction, keepdim)."""
    args = list(args)
    unbiased = args.pop(0) if args and isinstance(args[0], bool) else None
    dim = args.pop(0) if args else kwargs.get("dim")
    if args and unbiased is None:
        unbiased = args.pop(0)
    keepdim = args.pop(0) if args else kwargs.get("keepdim", False)
    unbiased = kwargs.get("unbiased", unbiased)
    correction = kwargs.get("correction")
    if correction is None:
        correction = 0 if unbiased is False else 1
    return dim, correction, keepdim


def variance(ctx, x, dim, correction, keepdim, tag: Tag):
    """(mean, centred x, variance) over `dim`: the mean, then the centred sum of squares over
    (count - correction), in float32 for half-precision inputs (layer norm's statistics too)."""
    dims = _dims(dim, x.rank)
    count = math.prod(x.shape[d] for d in dims)
    if count - correction <= 0:
        raise UnsupportedOpError("var/std", f"{count} element(s) with correction {correction} (eager gives nan or "
                                 "inf and a warning)", ctx.hint)
    acc = compute_dtype(x.dtype)
    mean = reduce(ctx, x, dims, "sum", scale=1.0 / count, dtype=acc, tag=tag, hint=f"{ctx.hint}_mean")
    xc = ctx.builder.emit(x.shape, acc, lambda o, r, rg: call("sub", upcast(x.read(o, rg), x),
                                                              _row_read(mean, o, dims, rg)),
                          tag=tag, hint=f"{ctx.hint}_centered")
    var = reduce(ctx, xc, dims, "sum", keepdim=keepdim, scale=1.0 / (count - correction),
                 pre=lambda e, o: call("mul", e, e), dtype=acc, tag=tag, hint=f"{ctx.hint}_var")
    return mean, xc, var


@lowering(torch.norm, "method:norm", torch.linalg.vector_norm, "aten.linalg_vector_norm", "aten.norm")
def lower_norm(ctx, x, p=2, dim=None, keepdim=False, *, ord=None, dtype=None, out=None):
    """Vector norms over `dim` (all of x by default), in float32 for half-precision inputs; torch.linalg.
    vector_norm spells p `ord`: inf and -inf are the largest and smallest |x|, 0 counts the non-zeros,
    any other p is (sum |x|^p)^(1/p)."""
    p = ord if ord is not None else p
    p = 2 if p in ("fro", None) else p
    if isinstance(p, str):
        raise UnsupportedOpError("norm", f"p={p!r} (numbers and 'fro' are lowered)", ctx.hint)
    tag = ctx.builder.new_tag("norm")
    acc = compute_dtype(x.dtype)
    if p in (math.inf, -math.inf):
        sign = 1 if p > 0 else -1
        peak = reduce(ctx, x, dim, "max", keepdim=keepdim, dtype=acc, tag=tag, hint=f"{ctx.hint}_peak",
                      pre=lambda e, o: call("abs", e) if sign > 0 else call("neg", call("abs", e)))
        return ctx.builder.emit(peak.shape, ctx.dtype, lambda o, r, rg: peak.read(o, rg) if sign > 0 else call(
            "neg", peak.read(o, rg)), tag=tag, hint=ctx.hint)
    if p == 0:
        return reduce(ctx, x, dim, "sum", keepdim=keepdim, dtype=ctx.dtype, tag=tag,
                      pre=lambda e, o: call("where", call("ne", e, Const(0.0)), Const(1.0), Const(0.0)))
    if p == 1:
        return reduce(ctx, x, dim, "sum", keepdim=keepdim, pre=lambda e, o: call("abs", e), dtype=ctx.dtype, tag=tag)
    power = (lambda e, o: call("mul", e, e)) if p == 2 else (lambda e, o: call("pow", call("abs", e), Const(float(p))))
    total = reduce(ctx, x, dim, "sum", keepdim=keepdim, pre=power, dtype=acc, tag=tag, hint=f"{ctx.hint}_powers")
    root = (lambda t: call("sqrt", t)) if p == 2 else (lambda t: call("pow", t, Const(1.0 / p)))
    return ctx.builder.emit(total.shape, ctx.dtype, lambda o, r, rg: root(total.read(o, rg)), tag=tag, hint=ctx.hint)


def _pointwise(ctx, op: str, a, b):
    """torch.max(a, b) and torch.min(a, b): the elementwise forms of the reductions."""
    from .ops_elementwise import elementwise

    return elementwise(ctx, lambda p, q: call(op, p, q), a, b)


def _reduced_read(v: TensorValue, o, dim):
    """Read a keepdim-less row statistic `v` at the output point `o` without the reduced `dim`."""
    return lambda rg: v.read([o[d] for d in range(len(o)) if d != dim], rg)


def softmax_parts(ctx: LowerCtx, x: TensorValue, dim: int, tag: Tag):
    """M = max_d x; E = exp(x - M); Z = sum_d E (float32 for half inputs)."""
    dim = V.norm_dim(dim, x.rank)
    acc = compute_dtype(x.dtype)
    m = reduce(ctx, x, [dim], "max", dtype=acc, tag=tag, hint=f"{ctx.hint}_max")
    b = ctx.builder

    def exp_body(o, r, rg):
        xs = upcast(x.read(o, rg), x)
        return call("exp", call("sub", xs, _reduced_read(m, o, dim)(rg)))

    e = b.emit(x.shape, acc, exp_body, tag=tag, hint=f"{ctx.hint}_exp")
    z = reduce(ctx, e, [dim], "sum", dtype=acc, tag=tag, hint=f"{ctx.hint}_sum")
    return dim, m, e, z


def _softmax_input(ctx, x: TensorValue, args, kwargs) -> TensorValue:
    """x in softmax's `dtype=` where one is given (torch casts before it computes: an integer input's
    softmax, a float64 one of float32 logits); aten._softmax's bool argument (half to float) is no dtype."""
    dtype = kwargs.get("dtype") or next((a for a in args if isinstance(a, torch.dtype)), None)
    return x if dtype is None else cast(ctx, x, dtype)


@lowering(torch.softmax, F.softmax, "method:softmax", "aten.softmax", "aten._softmax")
def lower_softmax(ctx, x, dim=None, *args, **kwargs):
    tag = ctx.builder.new_tag("softmax")
    x = _softmax_input(ctx, x, args, kwargs)
    dim, _, e, z = softmax_parts(ctx, x, dim, tag)
    return ctx.builder.emit(
        x.shape, ctx.dtype, lambda o, r, rg: call("div", e.read(o, rg), _reduced_read(z, o, dim)(rg)), tag=tag, hint=ctx.hint
    )


@lowering(torch.log_softmax, F.log_softmax, "method:log_softmax", "aten.log_softmax", "aten._log_softmax")
def lower_log_softmax(ctx, x, dim=None, *args, **kwargs):
    tag = ctx.builder.new_tag("log_softmax")
    x = _softmax_input(ctx, x, args, kwargs)
    dim, m, _, z = softmax_parts(ctx, x, dim, tag)

    def body(o, r, rg):
        shifted = call("sub", upcast(x.read(o, rg), x), _reduced_read(m, o, dim)(rg))
        return call("sub", shifted, call("log", _reduced_read(z, o, dim)(rg)))

    return ctx.builder.emit(x.shape, ctx.dtype, body, tag=tag, hint=ctx.hint)


def _norm_dims(x: TensorValue, normalized_shape) -> list[int]:
    n = len(normalized_shape) if isinstance(normalized_shape, (list, tuple, torch.Size)) else 1
    return list(range(x.rank - n, x.rank))


def _affine(e, o, dims, weight, bias, rg):
    """e * weight[trailing dims] + bias[trailing dims]."""
    tail = [o[d] for d in dims]
    if weight is not None:
        e = call("mul", e, upcast(weight.read(tail, rg), weight) if isinstance(weight, TensorValue) else Const(weight))
    if bias is not None:
        e = call("add", e, upcast(bias.read(tail, rg), bias) if isinstance(bias, TensorValue) else Const(bias))
    return e


def _row_read(v: TensorValue, o, dims, rg):
    return v.read([o[d] for d in range(len(o)) if d not in dims], rg)


def layer_norm(ctx, x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """mean, centred x, variance, then (x - mean) * rsqrt(var + eps) * w + b; stats in float32."""
    tag = ctx.builder.new_tag("layernorm")
    dims = _norm_dims(x, normalized_shape)
    mean, xc, var = variance(ctx, x, dims, 0, False, tag)

    def body(o, r, rg):
        e = call("mul", xc.read(o, rg), call("rsqrt", call("add", _row_read(var, o, dims, rg), Const(eps))))
        return _affine(e, o, dims, weight, bias, rg)

    out = ctx.builder.emit(x.shape, x.dtype, body, tag=tag, hint=ctx.hint)
    return out, mean, var


@lowering(F.layer_norm, "aten.layer_norm")
def lower_layer_norm(ctx, x, normalized_shape, weight=None, bias=None, eps=1e-5, *args):
    return layer_norm(ctx, x, normalized_shape, weight, bias, eps)[0]


@lowering("aten.native_layer_norm")
def lower_native_layer_norm(ctx, x, normalized_shape, weight, bias, eps):
    """(out, mean, rstd), the statistics with the normalised dims kept as 1s (what a layer norm's
    backward reads, so an AOTAutograd forward graph saves them)."""
    out, mean, var = layer_norm(ctx, x, normalized_shape, weight, bias, eps)
    dims = _norm_dims(x, normalized_shape)
    stats = ctx.out[1]

    def rstd(o, r, rg):
        return call("rsqrt", call("add", _row_read(var, o, dims, rg), Const(eps)))

    kept_mean = ctx.builder.emit(tuple(stats.shape), stats.dtype, lambda o, r, rg: _row_read(mean, o, dims, rg),
                                 hint=f"{ctx.hint}_mean")
    return out, kept_mean, ctx.builder.emit(tuple(ctx.out[2].shape), ctx.out[2].dtype, rstd, hint=f"{ctx.hint}_rstd")


@lowering(getattr(F, "rms_norm", None), getattr(torch, "rms_norm", None), "aten.rms_norm")  # Dynamo writes F's as torch's
def lower_rms_norm(ctx, x, normalized_shape, weight=None, eps=None):
    tag = ctx.builder.new_tag("rmsnorm")
    dims = _norm_dims(x, normalized_shape)
    count = math.prod(x.shape[d] for d in dims)
    acc = compute_dtype(x.dtype)
    eps = torch.finfo(acc).eps if eps is None else eps
    ms = reduce(ctx, x, dims, "sum", scale=1.0 / count, pre=lambda e, o: call("mul", e, e), dtype=acc, tag=tag,
                hint=f"{ctx.hint}_ms")

    def body(o, r, rg):
        e = call("mul", upcast(x.read(o, rg), x), call("rsqrt", call("add", _row_read(ms, o, dims, rg), Const(eps))))
        return _affine(e, o, dims, weight, None, rg)

    return ctx.builder.emit(x.shape, ctx.dtype, body, tag=tag, hint=ctx.hint)


# ---------------------------------------------------------------- batch norm

F_BATCH_NORM = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
ATEN_BATCH_NORM = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps",
                   "cudnn_enabled")


def _bound(names, args, kwargs) -> dict:
    out = dict(zip(names, args))
    out.update(kwargs)
    return out


def _running_statistics_refusal(names, batch_statistics: str, default: bool):
    """Refuses a norm that normalises by batch statistics and updates running ones in place."""
    def check(args, kwargs) -> str | None:
        a = _bound(names, args, kwargs)
        if a.get(batch_statistics, default) and a.get("running_mean") is not None:
            return ("with batch statistics it updates its running statistics in place (track_running_stats); "
                    "model.eval(), or track_running_stats=False, lets stitchflow compile it")
        return None
    return check


refusal(F.batch_norm)(_running_statistics_refusal(F_BATCH_NORM, "training", False))
refusal("aten.batch_norm")(_running_statistics_refusal(ATEN_BATCH_NORM, "training", False))


def batch_norm(ctx, x, running_mean=None, running_var=None, weight=None, bias=None, training=False, eps=1e-5):
    """Over dims (0, 2, ...) around the channel dim 1: with batch statistics (training, or no running
    statistics) the mean, the centred x and the biased variance, as layer norm; else the running ones.
    Statistics in float32 for half-precision x, as eager's kernels."""
    if x.rank < 2:
        raise UnsupportedOpError("batch_norm", f"needs a channel dimension, not a rank-{x.rank} input", ctx.hint)
    dims = [0, *range(2, x.rank)]
    acc = compute_dtype(x.dtype)
    b = ctx.builder

    def channel(v, o, rg):
        return upcast(v.read([o[1]], rg), v) if isinstance(v, TensorValue) else Const(v)

    if training or running_mean is None or running_var is None:
        tag = b.new_tag("batchnorm")
        count = math.prod(x.shape[d] for d in dims)
        mean = reduce(ctx, x, dims, "sum", scale=1.0 / count, dtype=acc, tag=tag, hint=f"{ctx.hint}_mean")
        centred = b.emit(x.shape, acc, lambda o, r, rg: call("sub", upcast(x.read(o, rg), x), mean.read([o[1]], rg)),
                         tag=tag, hint=f"{ctx.hint}_centered")
        var = reduce(ctx, centred, dims, "sum", scale=1.0 / count, pre=lambda e, o: call("mul", e, e), dtype=acc,
                     tag=tag, hint=f"{ctx.hint}_var")

        def normalised(o, rg):
            return call("mul", centred.read(o, rg), call("rsqrt", call("add", var.read([o[1]], rg), Const(eps))))
    else:
        tag = None

        def normalised(o, rg):
            centred = call("sub", upcast(x.read(o, rg), x), channel(running_mean, o, rg))
            return call("mul", centred, call("rsqrt", call("add", channel(running_var, o, rg), Const(eps))))

    def body(o, r, rg):
        e = normalised(o, rg)
        if weight is not None:
            e = call("mul", e, channel(weight, o, rg))
        return call("add", e, channel(bias, o, rg)) if bias is not None else e

    return b.emit(x.shape, x.dtype, body, tag=tag, hint=ctx.hint)


@lowering(F.batch_norm)
def lower_batch_norm(ctx, *args, **kwargs):
    a = _bound(F_BATCH_NORM, args, kwargs)
    return batch_norm(ctx, a["input"], a.get("running_mean"), a.get("running_var"), a.get("weight"), a.get("bias"),
                      a.get("training", False), a.get("eps", 1e-5))


@lowering("aten.batch_norm")
def lower_aten_batch_norm(ctx, *args, **kwargs):
    a = _bound(ATEN_BATCH_NORM, args, kwargs)
    return batch_norm(ctx, a["input"], a.get("running_mean"), a.get("running_var"), a.get("weight"), a.get("bias"),
                      a.get("training", False), a.get("eps", 1e-5))


# ---------------------------------------------------------------- group and instance norm

def group_norm(ctx, x, groups: int, weight=None, bias=None, eps=1e-5):
    return _group_norm(ctx, x, groups, weight, bias, eps)[0]


def _group_norm(ctx, x, groups: int, weight=None, bias=None, eps=1e-5):
    """(out, mean, var): statistics per (sample, group of channels) over the group's channels and
    spatial dims, as layer norm over x seen as [N, G, C/G, ...] (a split: affine indices), the
    per-channel weight and bias read as [G, C/G]. Statistics in float32 for halves."""
    if x.rank < 2 or x.shape[1] % groups:
        raise UnsupportedOpError("group_norm", f"{x.shape[1] if x.rank > 1 else 'no'} channels in {groups} groups",
                                 ctx.hint)
    n, c = x.shape[:2]
    b = ctx.builder
    view = V.reshape(x, (n, groups, c // groups, *x.shape[2:]))
    # a node of its own (the gpu target inlines it), so that both reductions read it with plain
    # indices and their axes unify: read through the view's arithmetic they did not, and split
    grouped = b.emit(view.shape, x.dtype, lambda o, r, rg: view.read(o, rg), hint=f"{ctx.hint}_grouped")
    dims = list(range(2, grouped.rank))
    count = math.prod(grouped.shape[d] for d in dims)
    acc = compute_dtype(x.dtype)
    tag = b.new_tag("groupnorm")
    mean = reduce(ctx, grouped, dims, "sum", scale=1.0 / count, dtype=acc, tag=tag, hint=f"{ctx.hint}_mean")
    xc = b.emit(grouped.shape, acc, lambda o, r, rg: call("sub", upcast(grouped.read(o, rg), x),
                                                          _row_read(mean, o, dims, rg)), tag=tag,
                hint=f"{ctx.hint}_centered")
    var = reduce(ctx, xc, dims, "sum", scale=1.0 / count, pre=lambda e, o: call("mul", e, e), dtype=acc, tag=tag,
                 hint=f"{ctx.hint}_var")
    per_group = [V.reshape(p, (groups, c // groups)) if isinstance(p, TensorValue) else p for p in (weight, bias)]

    def body(o, r, rg):
        e = call("mul", xc.read(o, rg), call("rsqrt", call("add", _row_read(var, o, dims, rg), Const(eps))))
        return _affine(e, o, [1, 2], *per_group, rg)

    # computed in the grouped coordinates and handed back as a view of x's shape, so that no
    # intermediate is read through the merge's index arithmetic (the gpu target splits there)
    return V.reshape(b.emit(grouped.shape, x.dtype, body, tag=tag, hint=ctx.hint), x.shape), mean, var


@lowering(F.group_norm, "aten.group_norm")
def lower_group_norm(ctx, x, num_groups, weight=None, bias=None, eps=1e-5, *args):
    return group_norm(ctx, x, num_groups, weight, bias, eps)


@lowering("aten.native_group_norm")
def lower_native_group_norm(ctx, x, weight, bias, n, c, hw, groups, eps):
    """(out, mean, rstd), the statistics per (sample, group): what a group norm's backward reads, so
    an AOTAutograd forward graph saves them (UNet's training step)."""
    out, mean, var = _group_norm(ctx, x, groups, weight, bias, eps)
    mean_type, rstd_type = ctx.out[1], ctx.out[2]

    def rstd(o, r, rg):
        e = call("rsqrt", call("add", var.read(o, rg), Const(eps)))
        return e if var.dtype == rstd_type.dtype else Cast(rstd_type.dtype, e)

    def kept_mean(o, r, rg):
        return mean.read(o, rg) if mean.dtype == mean_type.dtype else Cast(mean_type.dtype, mean.read(o, rg))
    b = ctx.builder
    return (out, b.emit(tuple(mean_type.shape), mean_type.dtype, kept_mean, hint=f"{ctx.hint}_mean"),
            b.emit(tuple(rstd_type.shape), rstd_type.dtype, rstd, hint=f"{ctx.hint}_rstd"))


F_INSTANCE_NORM = ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum", "eps")
ATEN_INSTANCE_NORM = ("input", "weight", "bias", "running_mean", "running_var", "use_input_stats", "momentum", "eps",
                      "cudnn_enabled")


refusal(F.instance_norm)(_running_statistics_refusal(F_INSTANCE_NORM, "use_input_stats", True))
refusal("aten.instance_norm")(_running_statistics_refusal(ATEN_INSTANCE_NORM, "use_input_stats", True))


def _instance_norm(ctx, a: dict):
    x = a["input"]
    if a.get("use_input_stats", True) or a.get("running_mean") is None:
        return group_norm(ctx, x, x.shape[1], a.get("weight"), a.get("bias"), a.get("eps", 1e-5))
    # running statistics per channel (eval): the same as batch norm's
    return batch_norm(ctx, x, a["running_mean"], a["running_var"], a.get("weight"), a.get("bias"), False,
                      a.get("eps", 1e-5))


@lowering(F.instance_norm)
def lower_instance_norm(ctx, *args, **kwargs):
    return _instance_norm(ctx, _bound(F_INSTANCE_NORM, args, kwargs))


@lowering("aten.instance_norm")
def lower_aten_instance_norm(ctx, *args, **kwargs):
    return _instance_norm(ctx, _bound(ATEN_INSTANCE_NORM, args, kwargs))


@lowering(torch.prod, "method:prod", "aten.prod")
def lower_prod(ctx, x, dim=None, keepdim=False, *, dtype=None):
    """Booleans and integers multiply as int64 (torch's result type), half precision in float32."""
    return reduce(ctx, x, dim, "prod", keepdim=keepdim, dtype=ctx.dtype, pre=_widened(ctx, x))
