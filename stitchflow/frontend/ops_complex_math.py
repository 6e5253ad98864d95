"""Elementary functions of complex values (ops_complex.py's pairs of real parts): log, sqrt, reciprocal, powers,
the trigonometric and hyperbolic functions, sigmoid, sgn, exp2, expm1 and log1p, each as two real formulas over the
parts a + ib; isnan, isinf and isfinite; vdot; vector norms (of the moduli).
Formulas are the textbook ones, arranged not to overflow or divide by zero where torch's results are finite:
sqrt takes the larger of its two half-angle parts directly and divides for the other, tanh and tan take their
limit once the exponential dominates, and a power of a small integer or one half is a product or a root.
What torch leaves to the C library at its branch cuts (the sign of a zero part) follows C99's conventions
where it costs nothing (sqrt of -4 - 0i is -2i)."""

from __future__ import annotations

import math
import operator

import torch

from ..ir.errors import UnsupportedOpError
from ..ir.expr import call
from .ops_complex import ComplexValue, bilinear, complex_lowering, lower_complex_abs, lower_complex_add, \
    lower_complex_div, lower_complex_exp, lower_complex_mul, lower_complex_neg, lower_complex_sub, lower_conj, modulus, \
    part_node, parts, real_dtype, real_kwargs
from .ops_elementwise import _c
from .ops_trig import cosh_expr, is_negative, sinh_expr
from .registry import LOWERINGS, sub_ctx

# past |x| = 20, tanh(x + iy)'s real part is ±1 and its imaginary part under 1e-17 in float64: the limit, where the
# formula's cosh(2x) would overflow past |x| = 44
TANH_FAR = 20.0


def _pair(ctx, z, real_of, imag_of) -> ComplexValue:
    """A complex result whose parts are real_of(a, b) and imag_of(a, b) of z's parts (an absent one 0)."""
    a, b = parts(z)
    dtype = real_dtype(ctx)

    def at(fn):
        return lambda a, b: fn(a, _c(0.0) if b is None else b)

    return ComplexValue(part_node(ctx, dtype, at(real_of), a, b), part_node(ctx, dtype, at(imag_of), a, b))


@complex_lowering(torch.log, "method:log", "aten.log")
def lower_complex_log(ctx, z, *, out=None):
    """log z = log|z| + i·arg z (log 0 = -inf + 0i)."""
    return _pair(ctx, z, lambda a, b: call("log", modulus(a, b)), lambda a, b: call("atan2", b, a))


def _scaled(scale: float):
    def lower(ctx, z, *, out=None):
        return _pair(ctx, z, lambda a, b: call("mul", call("log", modulus(a, b)), _c(scale)),
                     lambda a, b: call("mul", call("atan2", b, a), _c(scale)))
    return lower


complex_lowering(torch.log2, "method:log2", "aten.log2")(_scaled(1 / math.log(2)))
complex_lowering(torch.log10, "method:log10", "aten.log10")(_scaled(1 / math.log(10)))


def _root_parts(a, b):
    """(re, im) of the principal sqrt: t = sqrt((|z| + |a|) / 2) is the larger part, b / 2t the other."""
    t = call("sqrt", call("mul", call("add", modulus(a, b), call("abs", a)), _c(0.5)))
    other = call("div", call("abs", b), call("mul", call("where", call("eq", t, _c(0.0)), _c(1.0), t), _c(2.0)))
    right = call("ge", a, _c(0.0))
    real = call("where", right, t, other)
    imag = call("where", right, other, t)
    return real, call("where", is_negative(b), call("neg", imag), imag)


@complex_lowering(torch.sqrt, "method:sqrt", "aten.sqrt")
def lower_complex_sqrt(ctx, z, *, out=None):
    return _pair(ctx, z, lambda a, b: _root_parts(a, b)[0], lambda a, b: _root_parts(a, b)[1])


def _inverse_parts(a, b):
    """1 / (a + ib) = (a - ib) / |z|², scaled by the larger part so that |z|² neither overflows nor underflows."""
    big = call("max", call("abs", a), call("abs", b))
    s = call("where", call("eq", big, _c(0.0)), _c(1.0), big)
    x, y = call("div", a, s), call("div", b, s)
    norm = call("mul", call("add", call("mul", x, x), call("mul", y, y)), s)
    real = call("where", call("eq", norm, _c(0.0)), _c(math.inf), call("div", x, norm))  # 1 / 0 is inf + nan·i
    return real, call("neg", call("div", y, norm))


@complex_lowering(torch.reciprocal, "method:reciprocal", "aten.reciprocal")
def lower_complex_reciprocal(ctx, z, *, out=None):
    return _pair(ctx, z, lambda a, b: _inverse_parts(a, b)[0], lambda a, b: _inverse_parts(a, b)[1])


@complex_lowering(torch.rsqrt, "method:rsqrt", "aten.rsqrt")
def lower_complex_rsqrt(ctx, z, *, out=None):
    return lower_complex_reciprocal(ctx, lower_complex_sqrt(ctx, z))


@complex_lowering(torch.square, "method:square", "aten.square")
def lower_complex_square(ctx, z, *, out=None):
    return lower_complex_mul(ctx, z, z)


@complex_lowering(operator.pow, torch.pow, "method:pow", "aten.pow")
def lower_complex_pow(ctx, base, exponent, *, out=None):
    """base ** exponent: small integer and half powers as products and roots; a real exponent p in polar form,
    |z|^p·e^(i·p·arg z); a complex one as exp(w·log z)."""
    if isinstance(exponent, (int, float)) and not isinstance(exponent, bool):
        p = float(exponent)
        if p == 0.0:
            return _pair(ctx, base, lambda a, b: _c(1.0), lambda a, b: call("mul", b, _c(0.0)))
        if p in (1.0, 2.0, 3.0):
            out = base
            for _ in range(int(p) - 1):
                out = lower_complex_mul(ctx, out, base)
            return out if p > 1 else _pair(ctx, base, lambda a, b: a, lambda a, b: b)
        special = {-1.0: lower_complex_reciprocal, 0.5: lower_complex_sqrt, -0.5: lower_complex_rsqrt}
        if p in special:
            return special[p](ctx, base)

        def magnitude(a, b):
            return call("exp", call("mul", call("log", modulus(a, b)), _c(p)))

        def turned(fn):
            return lambda a, b: call("mul", magnitude(a, b), call(fn, call("mul", call("atan2", b, a), _c(p))))

        return _pair(ctx, base, turned("cos"), turned("sin"))
    power = lower_complex_exp(ctx, lower_complex_mul(ctx, exponent, lower_complex_log(ctx, base)))
    # 0 ** w is 0 where Re w > 0, as torch (exp(w · log 0) is NaN)
    return _at_zero(ctx, base, power, (0.0, 0.0), parts(exponent)[0], lambda w: call("gt", w, _c(0.0)))


def _at_zero(ctx, z, value: ComplexValue, fills: tuple, other=None, test=None) -> ComplexValue:
    """value with its parts replaced by `fills` where z is 0 (and, given another operand, where test(other))."""
    a, b = parts(z)

    def part(fill):
        def fn(a, b, other, r):
            zero = call("and", call("eq", a, _c(0.0)), call("eq", _c(0.0) if b is None else b, _c(0.0)))
            return call("where", zero if test is None else call("and", zero, test(other)), _c(fill), r)
        return fn

    dtype = real_dtype(ctx)
    return ComplexValue(*(part_node(ctx, dtype, part(fill), a, b, other, r) for fill, r in zip(fills, (value.real,
                                                                                                      value.imag))))


# ---------------------------------------------------------------- trigonometric and hyperbolic

@complex_lowering(torch.sin, "method:sin", "aten.sin")
def lower_complex_sin(ctx, z, *, out=None):
    """sin(a + ib) = sin a cosh b + i cos a sinh b."""
    return _pair(ctx, z, lambda a, b: call("mul", call("sin", a), cosh_expr(b)),
                 lambda a, b: call("mul", call("cos", a), sinh_expr(b)))


@complex_lowering(torch.cos, "method:cos", "aten.cos")
def lower_complex_cos(ctx, z, *, out=None):
    """cos(a + ib) = cos a cosh b - i sin a sinh b."""
    return _pair(ctx, z, lambda a, b: call("mul", call("cos", a), cosh_expr(b)),
                 lambda a, b: call("neg", call("mul", call("sin", a), sinh_expr(b))))


@complex_lowering(torch.sinh, "method:sinh", "aten.sinh")
def lower_complex_sinh(ctx, z, *, out=None):
    """sinh(a + ib) = sinh a cos b + i cosh a sin b."""
    return _pair(ctx, z, lambda a, b: call("mul", sinh_expr(a), call("cos", b)),
                 lambda a, b: call("mul", cosh_expr(a), call("sin", b)))


@complex_lowering(torch.cosh, "method:cosh", "aten.cosh")
def lower_complex_cosh(ctx, z, *, out=None):
    """cosh(a + ib) = cosh a cos b + i sinh a sin b."""
    return _pair(ctx, z, lambda a, b: call("mul", cosh_expr(a), call("cos", b)),
                 lambda a, b: call("mul", sinh_expr(a), call("sin", b)))


def _tanh_parts(a, b):
    """tanh(a + ib) = (sinh 2a + i sin 2b) / (cosh 2a + cos 2b); ±1 + 0i once |a| passes TANH_FAR."""
    a2, b2 = call("mul", a, _c(2.0)), call("mul", b, _c(2.0))
    far = call("gt", call("abs", a), _c(TANH_FAR))
    denominator = call("add", cosh_expr(a2), call("cos", b2))
    sign = call("where", call("lt", a, _c(0.0)), _c(-1.0), _c(1.0))
    return (call("where", far, sign, call("div", sinh_expr(a2), denominator)),
            call("where", far, call("mul", call("sin", b2), _c(0.0)), call("div", call("sin", b2), denominator)))


@complex_lowering(torch.tanh, "method:tanh", "aten.tanh")
def lower_complex_tanh(ctx, z, *, out=None):
    return _pair(ctx, z, lambda a, b: _tanh_parts(a, b)[0], lambda a, b: _tanh_parts(a, b)[1])


@complex_lowering(torch.tan, "method:tan", "aten.tan")
def lower_complex_tan(ctx, z, *, out=None):
    """tan z = -i·tanh(iz): with tanh(-b + ia) = (x, y), tan(a + ib) = y - ix."""
    return _pair(ctx, z, lambda a, b: _tanh_parts(call("neg", b), a)[1],
                 lambda a, b: call("neg", _tanh_parts(call("neg", b), a)[0]))


@complex_lowering(torch.sigmoid, "method:sigmoid", "aten.sigmoid")
def lower_complex_sigmoid(ctx, z, *, out=None):
    """1 / (1 + e^-z), e^-z = e^-a (cos b - i sin b)."""
    def denominator(a, b):
        e = call("exp", call("neg", a))
        return call("add", _c(1.0), call("mul", e, call("cos", b))), call("neg", call("mul", e, call("sin", b)))

    return _pair(ctx, z, lambda a, b: _inverse_parts(*denominator(a, b))[0],
                 lambda a, b: _inverse_parts(*denominator(a, b))[1])


@complex_lowering(torch.sinc, torch.special.sinc, "method:sinc", "aten.sinc")
def lower_complex_sinc(ctx, z, *, out=None):
    """sin(πz) / (πz), 1 at 0."""
    angle = lower_complex_mul(ctx, z, math.pi)
    return _at_zero(ctx, z, lower_complex_div(ctx, lower_complex_sin(ctx, angle), angle), (1.0, 0.0))


@complex_lowering(torch.sgn, "method:sgn", "aten.sgn")
def lower_complex_sgn(ctx, z, *, out=None):
    """z / |z|, 0 at 0."""
    def part(pick):
        def fn(a, b):
            r = modulus(a, b)
            return call("where", call("eq", r, _c(0.0)), _c(0.0), call("div", pick(a, b), r))
        return fn

    return _pair(ctx, z, part(lambda a, b: a), part(lambda a, b: b))


# ---------------------------------------------------------------- exponentials near zero, tests, norms

@complex_lowering(torch.exp2, "method:exp2", "aten.exp2")
def lower_complex_exp2(ctx, z, *, out=None):
    return lower_complex_exp(ctx, lower_complex_mul(ctx, z, math.log(2.0)))


@complex_lowering(torch.expm1, "method:expm1", "aten.expm1")
def lower_complex_expm1(ctx, z, *, out=None):
    """e^z - 1 = (expm1(a)·cos b - 2·sin²(b/2)) + i·e^a·sin b: no cancellation near 0."""
    def real(a, b):
        half = call("sin", call("mul", b, _c(0.5)))
        return call("sub", call("mul", call("expm1", a), call("cos", b)), call("mul", _c(2.0), call("mul", half, half)))

    return _pair(ctx, z, real, lambda a, b: call("mul", call("exp", a), call("sin", b)))


@complex_lowering(torch.log1p, "method:log1p", "aten.log1p")
def lower_complex_log1p(ctx, z, *, out=None):
    """log(1 + z): near 0 the real part is log1p(2a + a² + b²) / 2 (no cancellation), elsewhere log|1 + z|."""
    def real(a, b):
        near = call("mul", call("log1p", call("add", call("mul", a, call("add", a, _c(2.0))), call("mul", b, b))),
                    _c(0.5))
        small = call("lt", call("add", call("abs", a), call("abs", b)), _c(0.5))
        return call("where", small, near, call("log", modulus(call("add", a, _c(1.0)), b)))

    return _pair(ctx, z, real, lambda a, b: call("atan2", b, call("add", a, _c(1.0))))


def _test(either: bool, test):
    """A boolean test of a complex value: of either part (isnan, isinf) or of both (isfinite)."""
    def lower(ctx, z):
        a, b = parts(z)
        if b is None:
            return part_node(ctx, torch.bool, test, a)
        return part_node(ctx, torch.bool, lambda a, b: call("or" if either else "and", test(a), test(b)), a, b)
    return lower


complex_lowering(torch.isnan, "method:isnan", "aten.isnan")(_test(True, lambda a: call("ne", a, a)))
complex_lowering(torch.isinf, "method:isinf", "aten.isinf")(
    _test(True, lambda a: call("eq", call("abs", a), _c(math.inf))))
complex_lowering(torch.isfinite, "method:isfinite", "aten.isfinite")(
    _test(False, lambda a: call("and", call("eq", a, a), call("ne", call("abs", a), _c(math.inf)))))


@complex_lowering(torch.vdot, "method:vdot", "aten.vdot")
def lower_complex_vdot(ctx, a, b):
    """Σ conj(a)·b: the dot product of the conjugate, four real products."""
    dot = bilinear(torch.dot, LOWERINGS[torch.dot])
    return dot(ctx, lower_conj(ctx, a), b)


@complex_lowering(torch.norm, "method:norm", torch.linalg.vector_norm, "aten.linalg_vector_norm", "aten.norm")
def lower_complex_norm(ctx, z, *args, **kwargs):
    """A vector norm of complex values is the norm of their moduli."""
    moduli = lower_complex_abs(sub_ctx(ctx, z.shape, real_dtype(ctx), "abs"), z)
    return LOWERINGS[torch.linalg.vector_norm](ctx, moduli, *args, **kwargs)


# ---------------------------------------------------------------- products

def _polar_reduction(ctx, z, product, total, what: str) -> ComplexValue:
    """A product of complex values in polar form: the product of the moduli times e^(i·the sum of the angles)
    (`product` and `total` lower a real product and sum over z's shape into ctx's)."""
    if not isinstance(z, ComplexValue):
        raise UnsupportedOpError(what, "a product whose input is not a complex value", ctx.hint)
    a, b = parts(z)
    dtype = real_dtype(ctx)
    whole = sub_ctx(ctx, z.shape, dtype, "polar")
    moduli = part_node(whole, dtype, lambda a, b: modulus(a, _c(0.0) if b is None else b), a, b)
    angles = part_node(whole, dtype, lambda a, b: call("atan2", _c(0.0) if b is None else b, a), a, b)
    reduced = sub_ctx(ctx, ctx.shape, dtype, "parts")
    magnitude, angle = product(reduced, moduli), total(reduced, angles)
    return ComplexValue(part_node(ctx, dtype, lambda m, t: call("mul", m, call("cos", t)), magnitude, angle),
                        part_node(ctx, dtype, lambda m, t: call("mul", m, call("sin", t)), magnitude, angle))


@complex_lowering(torch.prod, "method:prod", "aten.prod")
def lower_complex_prod(ctx, z, *args, **kwargs):
    """The product over dims (all by default) in polar form (zero where a factor is zero)."""
    kwargs = real_kwargs(kwargs)
    return _polar_reduction(ctx, z, lambda c, m: LOWERINGS[torch.prod](c, m, *args, **kwargs),
                            lambda c, t: LOWERINGS[torch.sum](c, t, *args, **kwargs), "prod")


@complex_lowering(torch.cumprod, "method:cumprod", "aten.cumprod")
def lower_complex_cumprod(ctx, z, dim, **kwargs):
    """Running products in polar form: the running product of the moduli, the running sum of the angles."""
    kwargs = real_kwargs(kwargs)
    return _polar_reduction(ctx, z, lambda c, m: LOWERINGS[torch.cumprod](c, m, dim, **kwargs),
                            lambda c, t: LOWERINGS[torch.cumsum](c, t, dim, **kwargs), "cumprod")


# ---------------------------------------------------------------- inverse trigonometric and hyperbolic

def _add_number(ctx, z, number: complex):
    a, b = parts(z)
    dtype = real_dtype(ctx)
    real = part_node(ctx, dtype, lambda a: call("add", a, _c(number.real)), a)
    imag = b if not number.imag else part_node(ctx, dtype, lambda b: call("add", _c(0.0) if b is None else b,
                                                                       _c(number.imag)), b)
    return ComplexValue(real, imag)


def _times_i(ctx, z, sign: int = 1):
    """±i·z = ∓b ± i·a."""
    a, b = parts(z)
    dtype = real_dtype(ctx)
    real = part_node(ctx, dtype, lambda b: call("mul", _c(0.0) if b is None else b, _c(-float(sign))), b)
    return ComplexValue(real, part_node(ctx, dtype, lambda a: call("mul", a, _c(float(sign))), a))


def _odd(ctx, z, fn):
    """fn(z) for an odd fn evaluated on the half-plane Re z >= 0 (fn(z) = -fn(-z)), where its formula does not
    cancel."""
    a, b = parts(z)
    dtype = real_dtype(ctx)

    def flipped(x, a):
        return call("where", call("lt", a, _c(0.0)), call("neg", x), x)

    b = b if b is not None else part_node(ctx, dtype, lambda a: call("mul", a, _c(0.0)), a)
    right = ComplexValue(part_node(ctx, dtype, flipped, a, a), part_node(ctx, dtype, flipped, b, a))
    out = fn(right)
    return ComplexValue(part_node(ctx, dtype, flipped, out.real, a), part_node(ctx, dtype, flipped, out.imag, a))


@complex_lowering(torch.asinh, torch.arcsinh, "method:asinh", "method:arcsinh", "aten.asinh", "aten.arcsinh")
def lower_complex_asinh(ctx, z, *, out=None):
    """log(z + sqrt(z² + 1)), on the right half-plane (asinh is odd)."""
    def right(w):
        return lower_complex_log(ctx, lower_complex_add(ctx, w, lower_complex_sqrt(
            ctx, _add_number(ctx, lower_complex_mul(ctx, w, w), 1.0))))
    return _odd(ctx, z, right)


@complex_lowering(torch.acosh, torch.arccosh, "method:acosh", "method:arccosh", "aten.acosh", "aten.arccosh")
def lower_complex_acosh(ctx, z, *, out=None):
    """log(z + sqrt(z + 1)·sqrt(z - 1)) (Kahan's principal branch)."""
    roots = lower_complex_mul(ctx, lower_complex_sqrt(ctx, _add_number(ctx, z, 1.0)),
                              lower_complex_sqrt(ctx, _add_number(ctx, z, -1.0)))
    return lower_complex_log(ctx, lower_complex_add(ctx, z, roots))


@complex_lowering(torch.atanh, torch.arctanh, "method:atanh", "method:arctanh", "aten.atanh", "aten.arctanh")
def lower_complex_atanh(ctx, z, *, out=None):
    """(log1p(z) - log1p(-z)) / 2."""
    difference = lower_complex_sub(ctx, lower_complex_log1p(ctx, z),
                                   lower_complex_log1p(ctx, lower_complex_neg(ctx, z)))
    return lower_complex_mul(ctx, difference, 0.5)


@complex_lowering(torch.asin, torch.arcsin, "method:asin", "method:arcsin", "aten.asin", "aten.arcsin")
def lower_complex_asin(ctx, z, *, out=None):
    """-i·asinh(i·z)."""
    return _times_i(ctx, lower_complex_asinh(ctx, _times_i(ctx, z)), -1)


@complex_lowering(torch.acos, torch.arccos, "method:acos", "method:arccos", "aten.acos", "aten.arccos")
def lower_complex_acos(ctx, z, *, out=None):
    """π/2 - asin(z)."""
    return lower_complex_sub(ctx, math.pi / 2, lower_complex_asin(ctx, z))


@complex_lowering(torch.atan, torch.arctan, "method:atan", "method:arctan", "aten.atan", "aten.arctan")
def lower_complex_atan(ctx, z, *, out=None):
    """-i·atanh(i·z)."""
    return _times_i(ctx, lower_complex_atanh(ctx, _times_i(ctx, z)), -1)


def _scaled_sum(product_op):
    """beta·input + alpha·product(a, b) with complex values (addmm, addmv, baddbmm): the product as four real ones."""
    def lower(ctx, x, a, b, *, beta=1, alpha=1, out=None):
        product = bilinear(product_op, LOWERINGS[product_op])(ctx, a, b)
        scaled = product if alpha == 1 else lower_complex_mul(ctx, product, alpha)
        if beta == 0:  # input ignored, NaN included, as torch
            return scaled
        return lower_complex_add(ctx, x if beta == 1 else lower_complex_mul(ctx, x, beta), scaled)
    return lower


complex_lowering(torch.addmm, "aten.addmm", "method:addmm")(_scaled_sum(torch.mm))
complex_lowering(torch.addmv, "aten.addmv", "method:addmv")(_scaled_sum(torch.mv))
complex_lowering(torch.baddbmm, "aten.baddbmm", "method:baddbmm")(_scaled_sum(torch.bmm))
