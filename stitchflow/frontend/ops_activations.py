"""More elementwise ops, each a formula over the IR's scalar ops: the rest of torch.nn.functional's
activations, NaN and infinity tests, logs and exponentials in other bases, interpolation and fused
multiply-adds. Half-precision inputs compute in float32 and round once, as eager kernels do."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ir.errors import UnsupportedOpError
from ..ir.expr import Const, call
from .ops_elementwise import _activation, _c, elementwise
from . import values as V
from .registry import lowering

INF = Const(math.inf)


def _selu(a):
    alpha, scale_ = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946
    return call("mul", _c(scale_), call("where", call("gt", a, _c(0.0)), a, call("mul", _c(alpha), call("expm1", a))))


def _celu(a, *, alpha=1.0):
    return call("where", call("gt", a, _c(0.0)), a, call("mul", _c(alpha), call("expm1", call("div", a, _c(alpha)))))


def _logsigmoid(a):
    """min(x, 0) - log1p(exp(-|x|)): no overflow for large |x|."""
    return call("sub", call("min", a, _c(0.0)), call("log1p", call("exp", call("neg", call("abs", a)))))


def _softshrink(a, *, lambd=0.5):
    # the middle is a·0, as torch computes it: a NaN stays NaN
    return call("where", call("gt", a, _c(lambd)), call("sub", a, _c(lambd)),
                call("where", call("lt", a, _c(-lambd)), call("add", a, _c(lambd)), call("mul", a, _c(0.0))))


def _hardshrink(a, *, lambd=0.5):
    inside = call("and", call("ge", a, _c(-lambd)), call("le", a, _c(lambd)))  # false for a NaN, kept
    return call("where", inside, _c(0.0), a)


_activation((F.selu, torch.selu, "aten.selu"), "selu", _selu)
_activation((F.celu, torch.celu, "aten.celu"), "celu", _celu)
_activation((F.logsigmoid, torch._C._nn.log_sigmoid, "aten.log_sigmoid"), "logsigmoid", _logsigmoid)
_activation((F.softsign, "aten.softsign"), "softsign", lambda a: call("div", a, call("add", _c(1.0), call("abs", a))))
_activation((F.tanhshrink, "aten.tanhshrink"), "tanhshrink", lambda a: call("sub", a, call("tanh", a)))
_activation((F.hardshrink, torch.hardshrink, "method:hardshrink", "aten.hardshrink"), "hardshrink",
            _hardshrink)
_activation((F.softshrink, torch._C._nn.softshrink, "aten.softshrink"), "softshrink", _softshrink)
_activation((F.threshold, F._threshold, torch.threshold, "aten.threshold"), "threshold",
            lambda a, *, threshold=0.0, value=0.0: call("where", call("le", a, _c(threshold)), _c(value), a))
_activation((torch.log2, "method:log2", "aten.log2"), "log2", lambda a: call("mul", call("log", a), _c(1 / math.log(2))))
_activation((torch.log10, "method:log10", "aten.log10"), "log10",
            lambda a: call("mul", call("log", a), _c(1 / math.log(10))))
_activation((torch.exp2, torch.special.exp2, "method:exp2", "aten.exp2"), "exp2",
            lambda a: call("exp", call("mul", a, _c(math.log(2)))))
_activation((torch.logit, torch.special.logit, "method:logit", "aten.logit"), "logit", lambda a, *, eps=None: _logit(a, eps))


def _logit(a, eps):
    if eps is not None:
        a = call("min", call("max", a, _c(eps)), _c(1.0 - eps))
    return call("log", call("div", a, call("sub", _c(1.0), a)))


@lowering(F.rrelu, "aten.rrelu")
def lower_rrelu(ctx, x, lower=1.0 / 8, upper=1.0 / 3, training=False, inplace=False):
    if training:
        raise UnsupportedOpError("rrelu", "training mode draws a random slope per element; call model.eval()", ctx.hint)
    slope = (lower + upper) / 2
    return elementwise(ctx, lambda a: call("where", call("ge", a, _c(0.0)), a, call("mul", a, _c(slope))), x,
                       upcast_reads=True)


@lowering(F.prelu, torch.prelu, "aten.prelu", "aten._prelu_kernel")
def lower_prelu(ctx, x, weight):
    """A learned slope per channel (dim 1) or one for all."""
    if weight.rank == 1 and weight.shape[0] > 1 and x.rank >= 2:
        weight = V.reshape(weight, [weight.shape[0]] + [1] * (x.rank - 2))
    return elementwise(ctx, lambda a, w: call("where", call("gt", a, _c(0.0)), a, call("mul", w, a)), x, weight,
                       upcast_reads=True)


@lowering(torch.square, "method:square", "aten.square")
def lower_square(ctx, x):
    return elementwise(ctx, lambda a: call("mul", a, a), x)


def _bool_test(formula, integers: bool):
    """A test of floats; integers are finite and never NaN, so it is constant there (`integers`)."""
    def lower(ctx, x):
        if not x.dtype.is_floating_point:
            return elementwise(ctx, lambda a: call("eq" if integers else "ne", a, a), x)
        return elementwise(ctx, formula, x)

    return lower


def _isnan(a):
    return call("ne", a, a)


def _isinf(a):
    return call("eq", call("abs", a), INF)


lowering(torch.isnan, "method:isnan", "aten.isnan")(_bool_test(_isnan, False))
lowering(torch.isinf, "method:isinf", "aten.isinf")(_bool_test(_isinf, False))
lowering(torch.isfinite, "method:isfinite", "aten.isfinite")(
    _bool_test(lambda a: call("and", call("eq", a, a), call("ne", call("abs", a), INF)), True))
lowering(torch.isposinf, "aten.isposinf")(_bool_test(lambda a: call("eq", a, INF), False))
lowering(torch.isneginf, "aten.isneginf")(_bool_test(lambda a: call("eq", a, Const(-math.inf)), False))


@lowering(torch.nan_to_num, "method:nan_to_num", "aten.nan_to_num")
def lower_nan_to_num(ctx, x, nan=0.0, posinf=None, neginf=None):
    if not x.dtype.is_floating_point:
        return x
    info = torch.finfo(x.dtype)
    hi, lo = info.max if posinf is None else posinf, info.min if neginf is None else neginf

    def body(a):
        a = call("where", call("eq", a, INF), _c(hi), a)
        a = call("where", call("eq", a, Const(-math.inf)), _c(lo), a)
        return call("where", call("ne", a, a), _c(nan), a)

    return elementwise(ctx, body, x)


@lowering(torch.addcmul, "method:addcmul", "aten.addcmul")
def lower_addcmul(ctx, x, t1, t2, *, value=1):
    return elementwise(ctx, lambda a, b, c: call("add", a, call("mul", _c(value), call("mul", b, c))), x, t1, t2,
                       upcast_reads=True)


@lowering(torch.addcdiv, "method:addcdiv", "aten.addcdiv")
def lower_addcdiv(ctx, x, t1, t2, *, value=1):
    return elementwise(ctx, lambda a, b, c: call("add", a, call("mul", _c(value), call("div", b, c))), x, t1, t2,
                       upcast_reads=True)


@lowering(torch.lerp, "method:lerp", "aten.lerp")
def lower_lerp(ctx, start, end, weight):
    """torch's two-sided formula: start + w·(end - start) below w = 0.5, end - (end - start)·(1 - w) above."""
    def body(a, b, w):
        diff = call("sub", b, a)
        return call("where", call("lt", call("abs", w), _c(0.5)), call("add", a, call("mul", w, diff)),
                    call("sub", b, call("mul", diff, call("sub", _c(1.0), w))))

    return elementwise(ctx, body, start, end, weight, upcast_reads=True)


@lowering(torch.hypot, "method:hypot", "aten.hypot")
def lower_hypot(ctx, a, b):
    return elementwise(ctx, lambda x, y: call("sqrt", call("add", call("mul", x, x), call("mul", y, y))), a, b,
                       upcast_reads=True)


@lowering(torch.logaddexp, "method:logaddexp", "aten.logaddexp")
def lower_logaddexp(ctx, a, b):
    """max + log1p(exp(-|a - b|)); equal infinities give themselves (their difference is NaN)."""
    def body(x, y):
        big = call("max", x, y)
        mixed = call("add", big, call("log1p", call("exp", call("neg", call("abs", call("sub", x, y))))))
        return call("where", call("and", call("eq", x, y), call("eq", call("abs", x), INF)), x, mixed)

    return elementwise(ctx, body, a, b, upcast_reads=True)


@lowering(torch.xlogy, torch.special.xlogy, "method:xlogy", "aten.xlogy")
def lower_xlogy(ctx, x, y):
    """x·log(y), 0 where x is 0 (unless y is NaN)."""
    def body(a, b):
        product = call("where", call("eq", a, _c(0.0)), _c(0.0), call("mul", a, call("log", b)))
        return call("where", call("ne", b, b), b, product)

    return elementwise(ctx, body, x, y, upcast_reads=True)


def _nan_ignoring(op):
    def lower(ctx, a, b):
        def body(x, y):
            return call("where", call("ne", x, x), y, call("where", call("ne", y, y), x, call(op, x, y)))

        return elementwise(ctx, body, a, b)

    return lower


lowering(torch.fmax, "method:fmax", "aten.fmax")(_nan_ignoring("max"))
lowering(torch.fmin, "method:fmin", "aten.fmin")(_nan_ignoring("min"))
