"""Composite reductions: logsumexp, all/any, count_nonzero, normalisation and similarity, outer
products, and torch.nn.functional's regression and classification losses, each built from the IR's
reductions and elementwise nodes with the formula torch uses (so that infinities and NaN come out alike).
Statistics of half-precision inputs are taken in float32."""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F

from ..ir.errors import UnsupportedOpError
from ..ir.expr import Const, call
from . import values as V
from .ops_elementwise import elementwise
from .ops_linalg import contract
from .ops_reduce import _dims, lower_log_softmax, lower_norm, lower_softmax, reduce
from .registry import compute_dtype, lowering, sub_ctx
from .values import TensorValue

INF = Const(math.inf)


def _drop(o, dims):
    """The point of a statistic reduced over `dims` (no kept dims) seen from a point of its input."""
    return [v for d, v in enumerate(o) if d not in dims]


def _finite_or_zero(e):
    return call("where", call("eq", call("abs", e), INF), Const(0.0), e)


@lowering(torch.logsumexp, torch.special.logsumexp, "method:logsumexp", "aten.logsumexp")
def lower_logsumexp(ctx, x, dim, keepdim=False):
    """log(sum(exp(x - m))) + m, m the maximum or 0 where that is infinite (torch's formula: a row
    of -inf gives -inf, a row holding +inf gives +inf)."""
    dims = _dims(dim, x.rank)
    acc = compute_dtype(x.dtype)
    peak = reduce(ctx, x, dims, "max", dtype=acc, hint=f"{ctx.hint}_max")
    total = reduce(ctx, x, dims, "sum", dtype=acc, hint=f"{ctx.hint}_sum",
                   pre=lambda e, o: call("exp", call("sub", e, _finite_or_zero(peak.read(o, {})))))

    def body(o, r, rg):
        point = _drop(o, dims) if keepdim else o
        return call("add", call("log", total.read(point, rg)), _finite_or_zero(peak.read(point, rg)))

    return ctx.builder.emit(ctx.shape, ctx.dtype, body, hint=ctx.hint)


def _any_of(ctx, x, dim, keepdim, kept):
    """Whether any element over `dim` passes `kept` (a max over 0/1 in float32), as a bool tensor."""
    hits = reduce(sub_ctx(ctx, ctx.shape, torch.float32, "hits"), x, _dims(dim, x.rank), "max", keepdim=keepdim,
                  dtype=torch.float32, pre=lambda e, o: call("where", kept(e), Const(1.0), Const(0.0)))
    return hits


def _truth(e):
    return call("ne", e, Const(0))


@lowering(torch.any, "method:any", "aten.any")
def lower_any(ctx, x, dim=None, keepdim=False):
    hits = _any_of(ctx, x, dim, keepdim, _truth)
    return ctx.builder.emit(ctx.shape, torch.bool, lambda o, r, rg: call("gt", hits.read(o, rg), Const(0.0)),
                            hint=ctx.hint)


@lowering(torch.all, "method:all", "aten.all")
def lower_all(ctx, x, dim=None, keepdim=False):
    misses = _any_of(ctx, x, dim, keepdim, lambda e: call("eq", e, Const(0)))
    return ctx.builder.emit(ctx.shape, torch.bool, lambda o, r, rg: call("eq", misses.read(o, rg), Const(0.0)),
                            hint=ctx.hint)


@lowering(torch.count_nonzero, "method:count_nonzero", "aten.count_nonzero")
def lower_count_nonzero(ctx, x, dim=None):
    return reduce(ctx, x, dim, "sum", dtype=torch.int64,
                  pre=lambda e, o: call("where", _truth(e), Const(1), Const(0)))


@lowering(F.softmin, "aten.softmin")
def lower_softmin(ctx, x, dim=None, *args, **kwargs):
    negated = elementwise(sub_ctx(ctx, x.shape, x.dtype, "negated"), lambda a: call("neg", a), x)
    return lower_softmax(ctx, negated, dim)


def _p_norm(ctx, x, p, dim, step):
    """‖x‖_p over `dim` with kept dims, in float32 for halves (torch.linalg.vector_norm's rounding)."""
    shape = [1 if d in _dims(dim, x.rank) else n for d, n in enumerate(x.shape)]
    return lower_norm(sub_ctx(ctx, shape, compute_dtype(x.dtype), step), x, p, dim, True)


@lowering(F.normalize, "aten.normalize")
def lower_normalize(ctx, x, p=2.0, dim=1, eps=1e-12, out=None):
    """x / max(‖x‖_p, eps) over `dim`."""
    norm = _p_norm(ctx, x, p, dim, "norm")
    return elementwise(ctx, lambda a, n: call("div", a, call("max", n, Const(eps))), x, norm, upcast_reads=True)


@lowering(F.cosine_similarity, torch.cosine_similarity, "aten.cosine_similarity")
def lower_cosine_similarity(ctx, x1, x2, dim=1, eps=1e-8):
    """sum(x1·x2) / sqrt(max(‖x1‖²·‖x2‖², eps²)) over `dim` (ATen's formula)."""
    shape = list(torch.broadcast_shapes(x1.shape, x2.shape))
    a, b = V.expand(x1, shape), V.expand(x2, shape)
    dims, acc = _dims(dim, len(shape)), compute_dtype(ctx.dtype)

    def summed(step, fn, *operands):
        both = elementwise(sub_ctx(ctx, shape, acc, f"{step}_terms"), fn, *operands, upcast_reads=True)
        return reduce(sub_ctx(ctx, ctx.shape, acc, step), both, dims, "sum", dtype=acc, hint=f"{ctx.hint}_{step}")

    dot = summed("dot", lambda p, q: call("mul", p, q), a, b)
    n1 = summed("n1", lambda p: call("mul", p, p), a)
    n2 = summed("n2", lambda p: call("mul", p, p), b)
    return ctx.builder.emit(ctx.shape, ctx.dtype, lambda o, r, rg: call("div", dot.read(o, rg), call(
        "sqrt", call("max", call("mul", n1.read(o, rg), n2.read(o, rg)), Const(eps * eps)))), hint=ctx.hint)


@lowering(F.pairwise_distance, torch.pairwise_distance, "aten.pairwise_distance")
def lower_pairwise_distance(ctx, x1, x2, p=2.0, eps=1e-6, keepdim=False):
    """‖x1 - x2 + eps‖_p over the last dim."""
    shape = list(torch.broadcast_shapes(x1.shape, x2.shape))
    diff = elementwise(sub_ctx(ctx, shape, ctx.dtype, "diff"), lambda a, b: call("add", call("sub", a, b), Const(eps)),
                       x1, x2)
    return lower_norm(ctx, diff, p, -1, keepdim)


@lowering(torch.outer, torch.ger, "method:outer", "aten.outer")
def lower_outer(ctx, a, b):
    return elementwise(ctx, lambda x, y: call("mul", x, y), V.unsqueeze(a, 1), b)


# ---------------------------------------------------------------- losses

def _reduced(ctx, loss: TensorValue, reduction: str, count: int | None = None) -> TensorValue:
    """'none' keeps the elementwise loss; 'mean' and 'sum' reduce everything (float32 for halves)."""
    if reduction == "none":
        return loss
    if reduction not in ("mean", "sum", "batchmean"):
        raise UnsupportedOpError("loss", f"reduction={reduction!r}", ctx.hint)
    scale = None if reduction == "sum" else 1.0 / (count or math.prod(loss.shape))
    return reduce(ctx, loss, None, "sum", scale=scale, dtype=ctx.dtype)


def _bound(fn, args, kwargs) -> dict:
    """A loss's arguments by name with torch's defaults (FX passes some positionally, some by name);
    the deprecated size_average and reduce are refused."""
    bound = inspect.signature(fn).bind(None, None, *args, **kwargs)  # the two tensors are passed apart
    bound.apply_defaults()
    named = dict(bound.arguments)
    if named.get("size_average") is not None or named.get("reduce") is not None:
        raise UnsupportedOpError(fn.__name__, "the deprecated size_average/reduce arguments (use reduction)", None)
    return named


def _loss(ctx, fn, formula, operands, named, count_of=None):
    """An elementwise loss over the broadcast operands, then its reduction."""
    reduction = named.get("reduction", "mean")
    tensors = [t for t in operands if isinstance(t, TensorValue)]
    shape = list(torch.broadcast_shapes(*(t.shape for t in tensors)))
    step = sub_ctx(ctx, shape, ctx.dtype, "loss") if reduction != "none" else ctx
    loss = elementwise(step, formula, *operands, upcast_reads=True)
    return _reduced(ctx, loss, reduction, count_of(shape) if count_of and reduction == "batchmean" else None)


def _no_weight(fn, named):
    if named.get("weight") is not None:
        raise UnsupportedOpError(fn.__name__, "a weight argument", None)


def _squared(x, y):
    return call("mul", call("sub", x, y), call("sub", x, y))


@lowering(F.mse_loss, "aten.mse_loss")
def lower_mse_loss(ctx, a, b, *args, **kwargs):
    named = _bound(F.mse_loss, args, kwargs)
    _no_weight(F.mse_loss, named)
    return _loss(ctx, F.mse_loss, _squared, (a, b), named)


@lowering(F.l1_loss, "aten.l1_loss")
def lower_l1_loss(ctx, a, b, *args, **kwargs):
    named = _bound(F.l1_loss, args, kwargs)
    _no_weight(F.l1_loss, named)
    return _loss(ctx, F.l1_loss, lambda x, y: call("abs", call("sub", x, y)), (a, b), named)


def _piecewise(d, limit: float, inner, outer):
    return call("where", call("lt", d, Const(limit)), inner, outer)


@lowering(F.smooth_l1_loss, "aten.smooth_l1_loss")
def lower_smooth_l1_loss(ctx, a, b, *args, **kwargs):
    named = _bound(F.smooth_l1_loss, args, kwargs)
    beta = named.get("beta", 1.0)

    def formula(x, y):
        d = call("abs", call("sub", x, y))
        if beta == 0:
            return d
        return _piecewise(d, beta, call("div", call("mul", Const(0.5), call("mul", d, d)), Const(beta)),
                          call("sub", d, Const(0.5 * beta)))

    return _loss(ctx, F.smooth_l1_loss, formula, (a, b), named)


@lowering(F.huber_loss, "aten.huber_loss")
def lower_huber_loss(ctx, a, b, *args, **kwargs):
    named = _bound(F.huber_loss, args, kwargs)
    _no_weight(F.huber_loss, named)
    delta = named.get("delta", 1.0)

    def formula(x, y):
        d = call("abs", call("sub", x, y))
        return _piecewise(d, delta, call("mul", Const(0.5), call("mul", d, d)),
                          call("mul", Const(delta), call("sub", d, Const(0.5 * delta))))

    return _loss(ctx, F.huber_loss, formula, (a, b), named)


@lowering(F.binary_cross_entropy_with_logits, "aten.binary_cross_entropy_with_logits")
def lower_bce_with_logits(ctx, x, y, *args, **kwargs):
    """(1 - y)·x + (1 + (pw - 1)·y)·(log1p(exp(-|x|)) + max(-x, 0)) (ATen's stable form), times weight."""
    named = _bound(F.binary_cross_entropy_with_logits, args, kwargs)
    weight, pos_weight = named.get("weight"), named.get("pos_weight")

    def formula(a, b, *ws):
        w = ws[0] if weight is not None else None
        pw = ws[-1] if pos_weight is not None else None
        log_weight = Const(1.0) if pw is None else call("add", Const(1.0), call("mul", call("sub", pw, Const(1.0)), b))
        soft = call("add", call("log1p", call("exp", call("neg", call("abs", a)))), call("max", call("neg", a), Const(0.0)))
        loss = call("add", call("mul", call("sub", Const(1.0), b), a), call("mul", log_weight, soft))
        return call("mul", loss, w) if w is not None else loss

    extra = tuple(t for t in (weight, pos_weight) if t is not None)
    return _loss(ctx, F.binary_cross_entropy_with_logits, formula, (x, y, *extra), named)


@lowering(F.binary_cross_entropy, "aten.binary_cross_entropy")
def lower_binary_cross_entropy(ctx, p, y, *args, **kwargs):
    """-(y·max(log p, -100) + (1 - y)·max(log(1 - p), -100)) (torch clamps the logs at -100)."""
    named = _bound(F.binary_cross_entropy, args, kwargs)
    weight = named.get("weight")

    def formula(a, b, *ws):
        lp = call("max", call("log", a), Const(-100.0))
        lq = call("max", call("log", call("sub", Const(1.0), a)), Const(-100.0))
        loss = call("neg", call("add", call("mul", b, lp), call("mul", call("sub", Const(1.0), b), lq)))
        return call("mul", loss, ws[0]) if ws else loss

    return _loss(ctx, F.binary_cross_entropy, formula, (p, y, *([weight] if weight is not None else [])), named)


@lowering(F.kl_div, "aten.kl_div")
def lower_kl_div(ctx, x, target, *args, **kwargs):
    """xlogy(t, t) - t·x (0 where t is 0); exp(t)·(t - x) for log targets; batchmean divides by the batch."""
    named = _bound(F.kl_div, args, kwargs)

    def formula(a, t):
        if named.get("log_target"):
            return call("mul", call("exp", t), call("sub", t, a))
        xlogy = call("where", call("eq", t, Const(0.0)), Const(0.0), call("mul", t, call("log", t)))
        return call("sub", call("where", call("ne", t, t), t, xlogy), call("mul", t, a))

    return _loss(ctx, F.kl_div, formula, (x, target), named, count_of=lambda shape: shape[0] if shape else 1)


def _picked(logp: TensorValue, target: TensorValue) -> TensorValue:
    """logp[n, target[n, ..], ..]: the log-probability of each sample's class (dim 1)."""
    picked = V.gather_along(logp, 1, V.unsqueeze(target, 1))
    return V.select(picked, 1, 0)


def _nll(ctx, logp: TensorValue, target, named, fn):
    """-logp[n, t_n] (times weight[t_n]); targets equal to ignore_index count for nothing; 'mean' divides
    by the total weight of the counted targets, as torch does."""
    if not isinstance(target, TensorValue) or target.dtype.is_floating_point:
        raise UnsupportedOpError(fn.__name__, "class-probability targets (class indices are lowered)", ctx.hint)
    if named.get("label_smoothing", 0.0):
        raise UnsupportedOpError(fn.__name__, "label_smoothing", ctx.hint)
    ignore, weight, reduction = named.get("ignore_index", -100), named.get("weight"), named.get("reduction", "mean")
    picked = _picked(logp, target)
    w = V.gather_dim(weight, 0, target) if isinstance(weight, TensorValue) else None
    shape, acc = list(target.shape), compute_dtype(ctx.dtype)

    def kept(t):
        return call("ne", t, Const(ignore))

    def loss_of(p, t, *ws):
        value = call("neg", p) if not ws else call("mul", call("neg", p), ws[0])
        return call("where", kept(t), value, Const(0.0))

    operands = (picked, target, *([w] if w is not None else []))
    if reduction == "none":
        return elementwise(ctx, loss_of, *operands, upcast_reads=True)
    losses = elementwise(sub_ctx(ctx, shape, acc, "losses"), loss_of, *operands, upcast_reads=True)
    total = reduce(sub_ctx(ctx, [], acc, "total"), losses, None, "sum", dtype=acc, hint=f"{ctx.hint}_total")
    if reduction == "sum":
        return ctx.builder.emit((), ctx.dtype, lambda o, r, rg: total.read([], rg), hint=ctx.hint)
    counted = elementwise(sub_ctx(ctx, shape, acc, "counted"), lambda t, *ws: call(
        "where", kept(t), ws[0] if ws else Const(1.0), Const(0.0)), target, *([w] if w is not None else []),
        upcast_reads=True)
    count = reduce(sub_ctx(ctx, [], acc, "count"), counted, None, "sum", dtype=acc, hint=f"{ctx.hint}_count")
    return ctx.builder.emit((), ctx.dtype, lambda o, r, rg: call("div", total.read([], rg), count.read([], rg)),
                            hint=ctx.hint)


@lowering(F.nll_loss, "aten.nll_loss", "aten.nll_loss_nd")
def lower_nll_loss(ctx, logp, target, *args, **kwargs):
    return _nll(ctx, logp, target, _bound(F.nll_loss, args, kwargs), F.nll_loss)


@lowering(F.cross_entropy, "aten.cross_entropy_loss")
def lower_cross_entropy(ctx, x, target, *args, **kwargs):
    """log_softmax over the classes (dim 1), then the negative log-likelihood of the targets."""
    named = _bound(F.cross_entropy, args, kwargs)
    logp = lower_log_softmax(sub_ctx(ctx, x.shape, x.dtype, "log_softmax"), x, 1 if x.rank > 1 else 0)
    return _nll(ctx, logp, target, named, F.cross_entropy)


@lowering(torch.baddbmm, "method:baddbmm", "aten.baddbmm")
def lower_baddbmm(ctx, x, b1, b2, *, beta=1, alpha=1):
    product = contract(sub_ctx(ctx, ctx.shape, ctx.dtype, "product"), b1, b2)

    def body(p, q):
        p = call("mul", p, Const(alpha)) if alpha != 1 else p
        if beta == 0:  # torch ignores x then, NaN included
            return p
        return call("add", p, call("mul", q, Const(beta)) if beta != 1 else q)

    return elementwise(ctx, body, product, x)


@lowering(torch.linalg.norm, "aten.linalg_norm")
def lower_linalg_norm(ctx, x, ord=None, dim=None, keepdim=False, *, out=None, dtype=None):
    """Vector norms, and the Frobenius norm of matrices (the 2-norm of their entries); other matrix
    norms (spectral, nuclear) are refused."""
    matrix = (dim is None and x.rank == 2) or (isinstance(dim, (tuple, list)) and len(dim) == 2)
    if matrix and ord not in (None, "fro"):
        raise UnsupportedOpError("linalg.norm", f"the matrix norm ord={ord!r} (the Frobenius norm is lowered)", ctx.hint)
    return lower_norm(ctx, x, 2 if ord in (None, "fro") else ord, dim, keepdim)


@lowering(torch.cdist, "aten.cdist", "aten._cdist_forward")
def lower_cdist(ctx, x1, x2, p=2.0, compute_mode=None):
    """‖x1[.., i, :] - x2[.., j, :]‖_p, summed directly (torch may use a matrix product for large p=2
    inputs, which rounds differently)."""
    batch = list(torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2]))
    n, m, k = x1.shape[-2], x2.shape[-2], x1.shape[-1]
    shape = batch + [n, m, k]
    a = V.expand(V.unsqueeze(x1, -2), shape)
    b = V.expand(V.unsqueeze(x2, -3), shape)
    diff = elementwise(sub_ctx(ctx, shape, ctx.dtype, "diff"), lambda u, v: call("sub", u, v), a, b)
    return lower_norm(ctx, diff, p, -1, False)
