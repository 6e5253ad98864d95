"""Complex values in the frontend. The IR is real, so a complex tensor made inside a graph (a Fourier transform's
result, a real tensor made complex) is a ComplexValue of its two real parts while capture lowers the graph. What takes
it back to tensors: `.real`, `.imag`, torch.real / torch.imag, view_as_real, abs; what keeps it complex: conj,
products, sums, differences, quotients, negation and exp with complex, real or scalar operands (each part an
elementwise node; the other elementary functions are in ops_complex_math.py), matmul and einsum (four real
products, `bilinear`), and the views, reductions and scatters that act on each part alike (`partwise`). Any other op
that meets a ComplexValue is refused by capture with that reason (`takes_complex` marks the lowerings that accept
one, and COMPLEX_LOWERINGS holds the complex forms of arithmetic whose real lowering lives elsewhere). A complex
graph input or parameter enters as view_as_real's (..., 2) real tensor, and a complex output leaves as one that the
program views as complex again.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..ir.errors import UnsupportedOpError
from ..ir.expr import Const, IndexValue, call
from ..ir.types import TensorType, dense_type
from . import values as V
from .registry import LowerCtx, lowering, operand
from .values import TensorValue


@dataclass(frozen=True)
class ComplexValue:
    """A complex tensor as its real and imaginary parts; `imag` None is zero (a real tensor made complex)."""

    real: TensorValue
    imag: TensorValue | None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.real.shape


def takes_complex(fn):
    """Marks a lowering that accepts ComplexValue arguments (capture refuses them for every other)."""
    fn.takes_complex = True
    return fn


COMPLEX_LOWERINGS: dict = {}  # lowering key -> its form for complex operands


def complex_lowering(*keys):
    def register(fn):
        for key in keys:
            COMPLEX_LOWERINGS[key] = fn
        return fn
    return register


# ops that act on a complex tensor's real and imaginary parts alike: linear in their data tensors (by position; a
# list there is all data), with no arithmetic across the parts. Other tensor arguments (indices) must be real.
_FIRST = (0,)
PARTWISE = {name: _FIRST for name in (
    "getitem", "__getitem__", "slice", "select", "narrow", "permute", "transpose", "t", "reshape", "view",
    "_unsafe_view", "unsqueeze", "squeeze", "flatten", "unflatten", "expand", "contiguous", "clone", "alias", "flip",
    "roll", "movedim", "chunk", "split", "unbind", "repeat", "detach", "sum", "mean", "index_select", "gather",
    "take_along_dim", "expand_as", "view_as", "reshape_as")}
PARTWISE.update({"cat": _FIRST, "stack": _FIRST, "concat": _FIRST, "concatenate": _FIRST, "slice_scatter": (0, 1),
                 "select_scatter": (0, 1), "copy": (0, 1), "setitem": (0, 2), "__setitem__": (0, 2),
                 "where": (1, 2), "masked_fill": (0, 2), "index_copy": (0, 3), "index_add": (0, 3),
                 "index_put": (0, 2), "scatter": (0, 3), "scatter_add": (0, 3), "diff": (0, 3, 4)})
PARTWISE.update({name: _FIRST for name in (
    "diagonal", "fliplr", "flipud", "tril", "triu", "tile", "unfold", "tensor_split", "cumsum", "nan_to_num",
    "hsplit", "vsplit", "swapaxes", "swapdims", "moveaxis", "diag_embed")})


def _op_name(key) -> str:
    name = key.rsplit(":", 1)[-1].rsplit(".", 1)[-1] if isinstance(key, str) else getattr(key, "__name__", "")
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def partwise(key, fn):
    """fn applied to the real parts of its data arguments, then to their imaginary parts (a real data tensor's is
    zero); None where the op is not PARTWISE. The lowering's own argument names bind the call (`binds_as`)."""
    data = PARTWISE.get(_op_name(key))
    if fn is None or data is None:
        return None

    def run(ctx, *args, **kwargs):
        if any_complex(([a for k, a in enumerate(args) if k not in data], kwargs), numbers=True):
            raise UnsupportedOpError(_op_name(key), "a complex value where it takes indices or options", ctx.hint)
        dtype = real_dtype(ctx)
        kwargs = real_kwargs(kwargs)
        real = fn(_part_ctx(ctx, dtype, "re"), *_parts_of(ctx, args, data, "real"), **kwargs)
        if not any_imaginary([args[k] for k in data if k < len(args)]):
            imag = None
        else:
            imag = fn(_part_ctx(ctx, dtype, "im"), *_parts_of(ctx, args, data, "imag"), **kwargs)
        if isinstance(real, (tuple, list)):  # chunk, split, unbind: one complex value per piece
            return type(real)(ComplexValue(r, i) for r, i in zip(real, imag or [None] * len(real)))
        return ComplexValue(real, imag)

    run.takes_complex, run.binds_as = True, fn
    return run


BILINEAR = frozenset({"einsum", "matmul", "mm", "bmm", "__matmul__", "tensordot", "linear", "outer", "ger", "inner",
                      "dot", "mv", "kron"})


def bilinear(key, fn):
    """A product linear in each of two complex operands through its real lowering: (ar + i·ai)·(br + i·bi) =
    (ar·br - ai·bi) + i(ar·bi + ai·br), each term one real product (an einsum: a GEMM on the gpu target). None where
    the op is not BILINEAR."""
    if fn is None or _op_name(key) not in BILINEAR:
        return None

    def run(ctx, *args, **kwargs):
        positions = [k for k, a in enumerate(args) if isinstance(a, (ComplexValue, TensorValue))]
        if len(positions) != 2 or any_complex(kwargs):
            raise UnsupportedOpError(_op_name(key), "complex operands other than two tensors", ctx.hint)
        (ar, ai), (br, bi) = (parts(args[k]) for k in positions)
        dtype = real_dtype(ctx)

        def product(a, b, step):
            if a is None or b is None:
                return None
            call_args = list(args)
            call_args[positions[0]], call_args[positions[1]] = a, b
            return fn(_part_ctx(ctx, dtype, step), *call_args, **kwargs)

        real = combine(ctx, "sub", product(ar, br, "rr"), product(ai, bi, "ii"))
        imag = combine(ctx, "add", product(ar, bi, "ri"), product(ai, br, "ir"))
        return ComplexValue(real, imag)

    run.takes_complex, run.binds_as = True, fn
    return run


def combine(ctx: LowerCtx, op: str, a, b, hint: str | None = None):
    """a op b (add or sub) elementwise over two values of one shape; None is a zero term."""
    hint = hint or ctx.hint
    if b is None:
        return a
    if a is None:
        return b if op == "add" else ctx.builder.emit(b.shape, b.dtype, lambda o, r, rg: call("neg", b.read(o, rg)),
                                                      hint=hint)
    return ctx.builder.emit(a.shape, a.dtype, lambda o, r, rg: call(op, a.read(o, rg), b.read(o, rg)), hint=hint)


def any_imaginary(args) -> bool:
    found = []
    fx.node.map_aggregate(args, lambda a: found.append(a) if isinstance(a, ComplexValue) and a.imag is not None
                          else a)
    return bool(found)


def _parts_of(ctx: LowerCtx, args: tuple, data, which: str) -> list:
    """args with each data tensor replaced by its `which` part (a real tensor's imaginary part: zeros)."""
    def pick(a):
        if isinstance(a, ComplexValue):
            value = a.real if which == "real" else a.imag
            return value if value is not None else _zeros_like(ctx, a.real)
        if isinstance(a, TensorValue) and which == "imag":
            return _zeros_like(ctx, a)
        if isinstance(a, (int, float, complex)) and not isinstance(a, bool):  # x[i] = 2, where(m, 1j, z)
            return complex(a).real if which == "real" else complex(a).imag
        return a

    return [fx.node.map_aggregate(a, pick) if k in data else a for k, a in enumerate(args)]


def _zeros_like(ctx: LowerCtx, t: TensorValue) -> TensorValue:
    return ctx.builder.emit(t.shape, t.dtype, lambda o, r, rg: Const(0.0), hint=f"{ctx.hint}_zero")


def _part_ctx(ctx: LowerCtx, dtype: torch.dtype, step: str) -> LowerCtx:
    """ctx with the eager result's real counterpart (each piece's, for ops that return several)."""
    out = ctx.out
    if isinstance(out, torch.Tensor):
        meta = torch.empty(out.shape, dtype=dtype, device="meta")
    else:
        meta = type(out)(torch.empty(o.shape, dtype=dtype, device="meta") for o in out)
    return LowerCtx(ctx.builder, ctx.node, meta, step)


def any_complex(args, numbers: bool = False) -> bool:
    """Any complex value among args (and, with numbers, any Python complex number)?"""
    kinds = (ComplexValue, complex) if numbers else ComplexValue
    found = []
    fx.node.map_aggregate(args, lambda a: found.append(a) if isinstance(a, kinds) else a)
    return bool(found)


def as_complex(ctx: LowerCtx, x, what: str) -> ComplexValue:
    if isinstance(x, ComplexValue):
        return x
    if isinstance(x, TensorValue) and x.dtype in (torch.float32, torch.float64):
        return ComplexValue(x, None)
    raise UnsupportedOpError(what, f"an input of {getattr(x, 'dtype', type(x).__name__)} (real float32 or float64 "
                                   "tensors, or complex values made of them, are taken)", ctx.hint)


def part(ctx: LowerCtx, z, name: str) -> TensorValue:
    """z.real or z.imag; .real of a real tensor is the tensor (its .imag torch refuses itself)."""
    if isinstance(z, TensorValue):
        return z
    if not isinstance(z, ComplexValue):
        raise UnsupportedOpError(f".{name}", f"of a {type(z).__name__}", ctx.hint)
    value = z.real if name == "real" else z.imag
    return _zeros_like(ctx, z.real) if value is None else value


@lowering(torch.real, "aten.real")
@takes_complex
def lower_real(ctx, z):
    return part(ctx, z, "real")


@lowering(torch.imag, "aten.imag")
@takes_complex
def lower_imag(ctx, z):
    return part(ctx, z, "imag")


def to_pairs(builder, z: ComplexValue, hint: str = "pairs") -> TensorValue:
    """view_as_real's layout of z: out[..., 0] = real, out[..., 1] = imag (how a complex value leaves a graph)."""
    real = z.real
    imag = z.imag or builder.emit(z.shape, real.dtype, lambda o, r, rg: Const(0.0), hint=f"{hint}_imag")
    return builder.emit((*z.shape, 2), real.dtype, lambda o, r, rg: call(
        "where", call("eq", IndexValue(o[-1]), Const(0)), real.read(o[:-1], rg), imag.read(o[:-1], rg)), hint=hint)


def from_pairs(t: TensorValue) -> ComplexValue:
    """t[..., 0] + i·t[..., 1] (how a complex value enters a graph: view_as_real of its input)."""
    return ComplexValue(V.select(t, -1, 0), V.select(t, -1, 1))


def constant(builder, value: torch.Tensor) -> TensorValue | ComplexValue:
    """A constant of the program (folded, or made by a factory); a complex one held as its pairs."""
    if value.is_complex():
        return from_pairs(builder.add_param("const", as_pairs(value).clone()))
    return builder.add_param("const", value)


def pairs_type(value: torch.Tensor) -> TensorType:
    return dense_type((*value.shape, 2), value.dtype.to_real())


def as_pairs(value: torch.Tensor) -> torch.Tensor:
    """A complex tensor as the real (..., 2) tensor the program holds (a view, conjugation resolved)."""
    return torch.view_as_real(value.resolve_conj())


@lowering(torch.view_as_real, "aten.view_as_real")
@takes_complex
def lower_view_as_real(ctx, z):
    if not isinstance(z, ComplexValue):
        raise UnsupportedOpError("view_as_real", f"of a {type(z).__name__}", ctx.hint)
    return to_pairs(ctx.builder, z, ctx.hint)


@lowering(torch.view_as_complex, "aten.view_as_complex")
@takes_complex
def lower_view_as_complex(ctx, t):
    """A gradient made complex for a transform's backward."""
    if not isinstance(t, TensorValue) or t.shape[-1] != 2:
        raise UnsupportedOpError("view_as_complex", "a tensor whose last dim is not 2", ctx.hint)
    return from_pairs(t)


def part_node(ctx: LowerCtx, dtype: torch.dtype, fn, *operands) -> TensorValue:
    """One node over the eager result's shape: fn of the operands' broadcast reads (None stays None: a zero part)."""
    shape = ctx.shape

    def body(o, r, rg):
        return fn(*(None if x is None else operand(x, o, shape, rg) for x in operands))

    return ctx.builder.emit(shape, dtype, body, hint=ctx.hint)


def parts(x):
    """(real, imaginary) of an operand: a ComplexValue's parts, a real tensor or scalar with no imaginary part."""
    if isinstance(x, ComplexValue):
        return x.real, x.imag
    if isinstance(x, complex):
        return x.real, x.imag or None
    return x, None


def real_kwargs(kwargs: dict) -> dict:
    """Keyword arguments for a part's real lowering: a complex dtype= asked for becomes its real counterpart."""
    return {k: (v.to_real() if isinstance(v, torch.dtype) and v.is_complex else v) for k, v in kwargs.items()}


def real_dtype(ctx: LowerCtx) -> torch.dtype:
    """The eager result's real counterpart (of its first piece, for chunk, split and unbind)."""
    out = ctx.out if isinstance(ctx.out, torch.Tensor) else ctx.out[0]
    return out.dtype.to_real() if out.dtype.is_complex else out.dtype


def _sum_of(terms):
    """add/sub over (sign, expr) terms, None terms dropped; None when nothing is left."""
    out = None
    for sign, e in terms:
        if e is None:
            continue
        out = (call("neg", e) if sign < 0 else e) if out is None else call("add" if sign > 0 else "sub", out, e)
    return out


def _prod(a, b):
    return None if a is None or b is None else call("mul", a, b)


def _zero_if_none(e):
    return Const(0.0) if e is None else e


@complex_lowering(operator.mul, torch.mul, "method:mul", "aten.mul", operator.imul, "method:mul_")
def lower_complex_mul(ctx, a, b, *, out=None):
    """(ar + i·ai)(br + i·bi) = (ar·br - ai·bi) + i(ar·bi + ai·br)."""
    (ar, ai), (br, bi) = parts(a), parts(b)
    dtype = real_dtype(ctx)
    real = part_node(ctx, dtype, lambda ar, ai, br, bi: _zero_if_none(_sum_of(
        [(1, _prod(ar, br)), (-1, _prod(ai, bi))])), ar, ai, br, bi)
    if ai is None and bi is None:
        return ComplexValue(real, None)
    imag = part_node(ctx, dtype, lambda ar, ai, br, bi: _zero_if_none(_sum_of(
        [(1, _prod(ar, bi)), (1, _prod(ai, br))])), ar, ai, br, bi)
    return ComplexValue(real, imag)


def _add(ctx, a, b, sign: int, alpha=1):
    if alpha != 1:  # a + alpha·b, alpha·b a complex product
        b = lower_complex_mul(ctx, b, alpha)
    (ar, ai), (br, bi) = parts(a), parts(b)
    dtype = real_dtype(ctx)
    real = part_node(ctx, dtype, lambda x, y: _sum_of([(1, x), (sign, y)]), ar, br)
    if ai is None and bi is None:
        return ComplexValue(real, None)
    imag = part_node(ctx, dtype, lambda x, y: _zero_if_none(_sum_of([(1, x), (sign, y)])), ai, bi)
    return ComplexValue(real, imag)


@complex_lowering(operator.add, torch.add, "method:add", "aten.add", operator.iadd, "method:add_")
def lower_complex_add(ctx, a, b, *, alpha=1, out=None):
    return _add(ctx, a, b, 1, alpha)


@complex_lowering(operator.sub, torch.sub, "method:sub", "aten.sub", operator.isub, "method:sub_")
def lower_complex_sub(ctx, a, b, *, alpha=1, out=None):
    return _add(ctx, a, b, -1, alpha)


@complex_lowering(operator.truediv, torch.div, torch.true_divide, "method:div", "aten.div", operator.itruediv,
                  "method:div_")
def lower_complex_div(ctx, a, b, *, rounding_mode=None, out=None):
    """a / b = a · conj(b) / |b|²; by a real divisor, each part divided."""
    if rounding_mode is not None:
        raise UnsupportedOpError("div", f"rounding_mode={rounding_mode!r} with complex operands", ctx.hint)
    (ar, ai), (br, bi) = parts(a), parts(b)
    dtype = real_dtype(ctx)
    if bi is None:
        real = part_node(ctx, dtype, lambda x, y: call("div", x, y), ar, br)
        return ComplexValue(real, None if ai is None else part_node(ctx, dtype, lambda x, y: call("div", x, y),
                                                                       ai, br))
    norm = part_node(ctx, dtype, lambda x, y: call("add", call("mul", x, x), call("mul", y, y)), br, bi)
    real = part_node(ctx, dtype, lambda ar, ai, br, bi, n: call("div", _sum_of(
        [(1, _prod(ar, br)), (1, _prod(ai, bi))]), n), ar, ai, br, bi, norm)
    imag = part_node(ctx, dtype, lambda ar, ai, br, bi, n: call("div", _sum_of(
        [(1, _prod(ai, br)), (-1, _prod(ar, bi))]), n), ar, ai, br, bi, norm)
    return ComplexValue(real, imag)


@complex_lowering(torch.exp, "method:exp", "aten.exp")
def lower_complex_exp(ctx, z, *, out=None):
    """e^(a + ib) = e^a (cos b + i·sin b)."""
    real, imag = parts(z)
    dtype = real_dtype(ctx)
    if imag is None:
        return ComplexValue(part_node(ctx, dtype, lambda a: call("exp", a), real), None)
    return ComplexValue(part_node(ctx, dtype, lambda a, b: call("mul", call("exp", a), call("cos", b)), real, imag),
                        part_node(ctx, dtype, lambda a, b: call("mul", call("exp", a), call("sin", b)), real, imag))


@complex_lowering(operator.neg, torch.neg, "method:neg", "aten.neg")
def lower_complex_neg(ctx, z, *, out=None):
    real, imag = parts(z)
    dtype = real_dtype(ctx)
    return ComplexValue(part_node(ctx, dtype, lambda a: call("neg", a), real),
                        None if imag is None else part_node(ctx, dtype, lambda b: call("neg", b), imag))


def modulus(a, b):
    """|a + ib| scaled by the larger part, as hypot: neither overflows where |z| is finite nor underflows; inf where
    either part is infinite (even with a NaN beside it), NaN where a part is NaN otherwise."""
    big, small = call("max", call("abs", a), call("abs", b)), call("min", call("abs", a), call("abs", b))
    ratio = call("div", small, call("where", call("eq", big, Const(0.0)), Const(1.0), big))
    scaled = call("mul", big, call("sqrt", call("add", Const(1.0), call("mul", ratio, ratio))))
    infinite = call("or", call("eq", call("abs", a), Const(math.inf)), call("eq", call("abs", b), Const(math.inf)))
    nan = call("or", call("ne", a, a), call("ne", b, b))
    return call("where", infinite, Const(math.inf), call("where", nan, Const(math.nan), scaled))


@complex_lowering(torch.abs, "method:abs", "aten.abs", operator.abs)
def lower_complex_abs(ctx, z):
    """|z|: a spectrum's magnitude, a real tensor."""
    real, imag = parts(z)
    if imag is None:
        return part_node(ctx, ctx.dtype, lambda re: call("abs", re), real)
    return part_node(ctx, ctx.dtype, modulus, real, imag)


@lowering(torch.angle, "method:angle", "aten.angle")
@takes_complex
def lower_angle(ctx, z, *, out=None):
    """The argument atan2(imag, real): a spectrum's phase; a real tensor's is π where it is negative (NaN stays)."""
    if isinstance(z, ComplexValue) and z.imag is not None:
        return part_node(ctx, ctx.dtype, lambda a, b: call("atan2", b, a), z.real, z.imag)
    real = z.real if isinstance(z, ComplexValue) else z
    if not isinstance(real, TensorValue) or not real.dtype.is_floating_point:
        raise UnsupportedOpError("angle", f"of {getattr(real, 'dtype', type(real).__name__)}", ctx.hint)
    return part_node(ctx, ctx.dtype, lambda a: call("where", call("lt", a, Const(0.0)), Const(math.pi),
                                                        call("mul", a, Const(0.0))), real)


@lowering(torch.polar, "aten.polar")
@takes_complex
def lower_polar(ctx, magnitude, angle, *, out=None):
    """magnitude · e^(i·angle): rotary embeddings' frequencies (torchtitan's freqs_cis)."""
    dtype = real_dtype(ctx)
    return ComplexValue(part_node(ctx, dtype, lambda m, a: call("mul", m, call("cos", a)), magnitude, angle),
                        part_node(ctx, dtype, lambda m, a: call("mul", m, call("sin", a)), magnitude, angle))


@lowering(torch.complex, "aten.complex")
@takes_complex
def lower_complex(ctx, real, imag, *, out=None):
    dtype = real_dtype(ctx)
    return ComplexValue(part_node(ctx, dtype, lambda x: x, real), part_node(ctx, dtype, lambda x: x, imag))


@lowering(torch.conj, torch.conj_physical, "method:conj", "method:conj_physical", "aten.conj", "aten._conj",
          "aten.conj_physical", "aten._conj_physical", "method:resolve_conj", "aten.resolve_conj", torch.resolve_conj)
@takes_complex
def lower_conj(ctx, z):
    """The conjugate (a real tensor's is itself); resolve_conj changes nothing of the value."""
    if not isinstance(z, ComplexValue) or z.imag is None or "resolve" in str(getattr(ctx.node.target, "__name__",
                                                                                         ctx.node.target)):
        return z
    imag = z.imag
    return ComplexValue(z.real, ctx.builder.emit(z.shape, imag.dtype, lambda o, r, rg: call("neg", imag.read(o, rg)),
                                                 hint=ctx.hint))
