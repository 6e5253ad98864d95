"""Trigonometric and hyperbolic functions, their inverses, angle helpers and the complementary error
function, as formulas over the IR's scalar ops (atan2 the only primitive they add). Each formula is chosen
not to cancel where torch's libm is accurate: sinh near 0 through expm1, the inverse hyperbolics through
log1p, asin and acos through atan2 of exact differences, erfc of large x through exp of exact parts.
Half-precision inputs compute in float32 and round once."""

from __future__ import annotations

import math

import torch

from ..ir.expr import Const, call
from .ops_elementwise import _activation, _c, elementwise
from .registry import lowering

LN2 = math.log(2.0)
# past 2^28, 1 + x*x rounds to x*x in float32: asinh(x) = log(2|x|) to the last bit (and x*x may overflow)
LARGE = 2.0 ** 28
# past |x| = 9, e^-|x| is under 2^-12 of e^|x|: sinh takes e^|x| / 2 as two half-size exponentials, which
# stay finite up to sinh's own overflow at 89.4 where e^|x| overflows at 88.7
SINH_FAR = 9.0


def is_negative(a):
    """a < 0, counting -0 (1 / -0 is -inf)."""
    return call("or", call("lt", a, _c(0.0)), call("and", call("eq", a, _c(0.0)), call("lt", call("div", _c(1.0), a), _c(0.0))))


def _with_sign_of(a, magnitude):
    return call("where", call("lt", a, _c(0.0)), call("neg", magnitude), magnitude)


def _tan(a):
    return call("div", call("sin", a), call("cos", a))


def _half_exponential_squared(a):
    """e^|a| / 2 as (e^(|a|/2) / 2) * e^(|a|/2): finite wherever the result is."""
    h = call("exp", call("mul", call("abs", a), _c(0.5)))
    return call("mul", call("mul", h, _c(0.5)), h)


def sinh_expr(a):
    e = call("expm1", call("abs", a))
    near = call("mul", _c(0.5), call("add", e, call("div", e, call("add", e, _c(1.0)))))
    far = _half_exponential_squared(a)
    return _with_sign_of(a, call("where", call("lt", call("abs", a), _c(SINH_FAR)), near, far))


def cosh_expr(a):
    h = call("exp", call("mul", call("abs", a), _c(0.5)))
    return call("add", _half_exponential_squared(a), call("div", _c(0.5), call("mul", h, h)))


def _one_minus_square_root(a):
    """sqrt(1 - a^2) as sqrt((1 - a)(1 + a)): 1 - a is exact near 1, where 1 - a*a cancels."""
    return call("sqrt", call("mul", call("sub", _c(1.0), a), call("add", _c(1.0), a)))


def _asin(a):
    return call("atan2", a, _one_minus_square_root(a))


def _acos(a):
    return call("atan2", _one_minus_square_root(a), a)


def _atan(a):
    return call("atan2", a, _c(1.0))


def _asinh(a):
    m = call("abs", a)
    square = call("mul", m, m)
    near = call("log1p", call("add", m, call("div", square, call("add", _c(1.0), call("sqrt", call("add", _c(1.0), square))))))
    far = call("add", call("log", m), _c(LN2))
    return _with_sign_of(a, call("where", call("lt", m, _c(LARGE)), near, far))


def _acosh(a):
    t = call("sub", a, _c(1.0))
    near = call("log1p", call("add", t, call("sqrt", call("add", call("mul", t, _c(2.0)), call("mul", t, t)))))
    far = call("add", call("log", a), _c(LN2))
    inside = call("where", call("lt", a, _c(LARGE)), near, far)
    return call("where", call("lt", a, _c(1.0)), Const(math.nan), inside)


def _atanh(a):
    m = call("abs", a)
    return _with_sign_of(a, call("mul", _c(0.5), call("log1p", call("div", call("mul", m, _c(2.0)), call("sub", _c(1.0), m)))))


def _sinc(a):
    """sin(pi x) / (pi x), 1 at 0."""
    px = call("mul", a, _c(math.pi))
    return call("where", call("eq", a, _c(0.0)), _c(1.0), call("div", call("sin", px), px))


for _name, _formula in {"tan": _tan, "sinh": sinh_expr, "cosh": cosh_expr, "asin": _asin, "acos": _acos, "atan": _atan,
                        "asinh": _asinh, "acosh": _acosh, "atanh": _atanh}.items():
    _alias = "arc" + _name[1:]  # torch.arcsin is torch.asin
    _keys = (getattr(torch, _name), f"method:{_name}", f"aten.{_name}")
    if _name[0] == "a":
        _keys += (getattr(torch, _alias), f"method:{_alias}", f"aten.{_alias}")
    _activation(_keys, _name, _formula)
_activation((torch.sinc, torch.special.sinc, "method:sinc", "aten.sinc"), "sinc", _sinc)
_activation((torch.deg2rad, "method:deg2rad", "aten.deg2rad"), "deg2rad", lambda a: call("mul", a, _c(math.pi / 180.0)))
_activation((torch.rad2deg, "method:rad2deg", "aten.rad2deg"), "rad2deg", lambda a: call("mul", a, _c(180.0 / math.pi)))


@lowering(torch.atan2, torch.arctan2, "method:atan2", "method:arctan2", "aten.atan2", "aten.arctan2")
def lower_atan2(ctx, y, x, *, out=None):
    return elementwise(ctx, lambda a, b: call("atan2", a, b), y, x, upcast_reads=True)


@lowering(torch.copysign, "method:copysign", "aten.copysign")
def lower_copysign(ctx, a, b):
    """|a| with b's sign bit (-0 counts as negative; floats out, as torch, for integer operands)."""
    return elementwise(ctx, lambda x, y: call("where", is_negative(y), call("neg", call("abs", x)), call("abs", x)),
                       a, b, upcast_reads=True)


@lowering(torch.signbit, "method:signbit", "aten.signbit")
def lower_signbit(ctx, x):
    if not x.dtype.is_floating_point:
        return elementwise(ctx, lambda a: call("lt", a, Const(0)), x)
    return elementwise(ctx, is_negative, x)


# erfc(x) = t exp(-x^2 + P(t)), t = 1 / (1 + x/2), for x >= 0: Numerical Recipes' erfcc (Press et al., 2nd ed.,
# section 6.2), fractional error under 1.2e-7 everywhere. P's coefficients, constant term first:
ERFC_P = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398, 1.48851587,
          -0.82215223, 0.17087277)
ERFC_NEAR = 0.5  # under it, 1 - erf(x): erf(x) < 0.53 there, so the difference loses under a bit
ERFC_FAR = 11.0  # erfc(11) is 1e-54, 0 in float32; past it (infinity included) x is taken as 11


def _erfc(a):
    """1 - erf(x) near 0; else the formula above at z = |x| (2 minus it for x < 0), with -z^2 taken as
    -h^2 - (z - h)(z + h), h = z truncated to 8 fractional bits: h^2 and z - h are exact in float32, so
    nothing rounds the exponent's large part (rounding -z^2 itself would cost 8 ulps at z = 9). exp(-h^2)
    is applied as two halves, which keeps the product normal until its last step. In float32, within 1e-6 of
    the exact value (5e-7 measured; eager's libm 1e-7) wherever that is a normal float32, within 3 units of
    2^-149 below them (tests/frontend/test_ops_gaps.py)."""
    z = call("min", call("abs", a), _c(ERFC_FAR))
    t = call("div", _c(1.0), call("add", _c(1.0), call("mul", z, _c(0.5))))
    p = _c(ERFC_P[-1])
    for c in reversed(ERFC_P[:-1]):
        p = call("add", call("mul", p, t), _c(c))
    h = call("div", call("trunc", call("mul", z, _c(256.0))), _c(256.0))
    half = call("exp", call("mul", call("mul", h, h), _c(-0.5)))
    low = call("mul", call("sub", z, h), call("add", z, h))
    tail = call("mul", call("mul", call("mul", t, call("exp", call("sub", p, low))), half), half)
    far = call("where", call("lt", a, _c(0.0)), call("sub", _c(2.0), tail), tail)
    return call("where", call("lt", call("abs", a), _c(ERFC_NEAR)), call("sub", _c(1.0), call("erf", a)), far)


_activation((torch.erfc, torch.special.erfc, "method:erfc", "aten.erfc", "aten.special_erfc"), "erfc", _erfc)
