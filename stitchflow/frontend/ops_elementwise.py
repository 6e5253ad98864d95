"""Lowerings of elementwise ops: arithmetic, activations, comparisons, selects and casts."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from ..ir.activations import BODIES
from ..ir.errors import UnsupportedOpError
from ..ir.expr import Cast, Const, call
from .ops_complex import ComplexValue, takes_complex
from .registry import LOW_PRECISION, LowerCtx, lowering, operand, sub_ctx, upcast
from . import values as V
from .values import TensorValue

aten = torch.ops.aten


def elementwise(ctx: LowerCtx, fn, *operands, tag=None, hint=None, upcast_reads=False):
    """One node out[o] = fn(*reads) over the broadcast shape of the eager result. Where an operand
    is a whole node seen through a reshape (group norm's output in x's shape), the node is computed
    in that node's coordinates (the other operands read through the inverse reshape) and handed
    out as the same view: a consumer then reads its producer with plain indices, which the gpu
    target fuses, instead of through the reshape's div/mod, where it splits the kernel."""
    shape, dtype = ctx.shape, ctx.dtype
    coords = _viewed_coords(ctx, operands, shape)
    if coords is not None:
        operands = tuple(V.reshape(V.expand(x, shape), coords) if isinstance(x, TensorValue) else x for x in operands)

    def body(o, r, rg):
        args = [operand(x, o, coords or shape, rg) for x in operands]
        if upcast_reads:
            args = [upcast(a, x) for a, x in zip(args, operands)]
        return fn(*args)

    tag = ctx.builder.new_tag(tag) if isinstance(tag, str) else tag
    out = ctx.builder.emit(coords or shape, dtype, body, tag=tag, hint=hint or ctx.hint)
    return V.reshape(out, shape) if coords is not None else out


def _viewed_coords(ctx: LowerCtx, operands, shape) -> tuple | None:
    """The shape of the node that an operand of the result's shape views whole through a reshape,
    when every other operand that is a node reads plainly in that node's coordinates too (else a
    node would be read through the inverse reshape instead); or None."""
    b = ctx.builder
    found = [b.reshaped_node(x) for x in operands if isinstance(x, TensorValue) and x.shape == tuple(shape)]
    bases = [name for name in found if name is not None]
    if not bases:
        return None
    coords = b.types[bases[0]].shape
    for x in operands:
        if isinstance(x, TensorValue) and x.base in b.node_names:
            seen = V.reshape(V.expand(x, shape), coords)
            if not (seen.is_identity and b.types[x.base].shape == coords):
                return None
    return coords


def _binary(op):
    def lower(ctx, a, b, *, alpha=1, out=None):
        if alpha != 1:
            return elementwise(ctx, lambda x, y: call(op, x, call("mul", y, Const(alpha))), a, b)
        return elementwise(ctx, lambda x, y: call(op, x, y), a, b)

    return lower


def _reverse(op):
    def lower(ctx, a, b, *, alpha=1):
        return elementwise(ctx, lambda x, y: call(op, y, call("mul", x, Const(alpha)) if alpha != 1 else x), a, b)

    return lower


lowering(operator.add, operator.iadd, torch.add, "method:add", "method:__add__", "aten.add")(_binary("add"))
lowering(operator.sub, operator.isub, torch.sub, torch.subtract, "method:sub", "aten.sub")(_binary("sub"))
lowering(operator.mul, operator.imul, torch.mul, torch.multiply, "method:mul", "aten.mul")(_binary("mul"))
lowering(torch.rsub, "aten.rsub")(_reverse("sub"))
lowering(torch.maximum, "method:maximum", "aten.maximum")(_binary("max"))
lowering(torch.minimum, "method:minimum", "aten.minimum")(_binary("min"))
lowering(operator.pow, torch.pow, "method:pow", "aten.pow")(_binary("pow"))
for _name, _ops in {
    "lt": (operator.lt, torch.lt, "method:lt", "aten.lt"),
    "le": (operator.le, torch.le, "method:le", "aten.le"),
    "gt": (operator.gt, torch.gt, "method:gt", "aten.gt"),
    "ge": (operator.ge, torch.ge, "method:ge", "aten.ge"),
    "eq": (operator.eq, torch.eq, "method:eq", "aten.eq"),
    "ne": (operator.ne, torch.ne, "method:ne", "aten.ne"),
    "and": (torch.logical_and, "method:logical_and", "aten.logical_and"),
    "or": (torch.logical_or, "method:logical_or", "aten.logical_or"),
}.items():
    lowering(*_ops)(_binary(_name))


def _unary(op, upcast_reads=True):
    def lower(ctx, x, *args, **kwargs):
        return elementwise(ctx, lambda a: call(op, a), x, upcast_reads=upcast_reads)

    return lower


for _op, _keys in {
    "neg": (operator.neg, torch.neg, "method:neg", "aten.neg"),
    "abs": (torch.abs, "method:abs", "aten.abs"),
    "exp": (torch.exp, "method:exp", "aten.exp"),
    "log": (torch.log, "method:log", "aten.log"),
    "sqrt": (torch.sqrt, "method:sqrt", "aten.sqrt"),
    "rsqrt": (torch.rsqrt, "method:rsqrt", "aten.rsqrt"),
    "recip": (torch.reciprocal, "method:reciprocal", "aten.reciprocal"),
    "tanh": (torch.tanh, F.tanh, "method:tanh", "aten.tanh"),
    "sigmoid": (torch.sigmoid, F.sigmoid, "method:sigmoid", "aten.sigmoid"),
    "erf": (torch.erf, torch.special.erf, "method:erf", "aten.erf"),
    "not": (torch.logical_not, "method:logical_not", "aten.logical_not"),
    "sin": (torch.sin, "method:sin", "aten.sin"),
    "cos": (torch.cos, "method:cos", "aten.cos"),
    "log1p": (torch.log1p, "method:log1p", "aten.log1p"),
    "expm1": (torch.expm1, "method:expm1", "aten.expm1"),
}.items():
    lowering(*_keys)(_unary(_op))


def _rounding(op):
    """floor, ceil and round: integers are already whole (torch returns them unchanged)."""
    def lower(ctx, x, *args, decimals=0, **kwargs):
        if decimals:
            raise UnsupportedOpError(op, f"decimals={decimals}", ctx.hint)
        if isinstance(x, TensorValue) and not x.dtype.is_floating_point:
            return x
        return elementwise(ctx, lambda a: call(op, a), x, upcast_reads=True)

    return lower


for _op in ("floor", "ceil", "round"):
    lowering(getattr(torch, _op), f"method:{_op}", f"aten.{_op}")(_rounding(_op))
lowering(torch.trunc, torch.fix, "method:trunc", "method:fix", "aten.trunc", "aten.fix")(_rounding("trunc"))


@lowering(torch.frac, "method:frac", "aten.frac")
def lower_frac(ctx, x):
    return elementwise(ctx, lambda a: call("sub", a, call("trunc", a)), x, upcast_reads=True)


@lowering(torch.sign, torch.sgn, "method:sign", "method:sgn", "aten.sign", "aten.sgn")
def lower_sign(ctx, x):
    """1, -1 or 0 (NaN gives 0, as torch.sign); a bool is its own sign."""
    if x.dtype == torch.bool:
        return x
    one, zero = (Const(1.0), Const(0.0)) if ctx.dtype.is_floating_point else (Const(1), Const(0))
    return elementwise(ctx, lambda a: call("where", call("gt", a, zero), one,
                                           call("where", call("lt", a, zero), call("neg", one), zero)), x)


@lowering(operator.truediv, operator.itruediv, torch.div, torch.divide, torch.true_divide, "method:div",
          "method:divide", "method:true_divide", "aten.div", "aten.divide", "aten.true_divide")
def lower_div(ctx, a, b, *, rounding_mode=None, out=None):
    if rounding_mode is None:
        return elementwise(ctx, lambda x, y: call("div", x, y), a, b)
    if rounding_mode not in ("floor", "trunc"):
        raise UnsupportedOpError("div", f"rounding_mode={rounding_mode!r}", ctx.hint)
    return _division(ctx, "floordiv" if rounding_mode == "floor" else "truncdiv", a, b)


def _division(ctx, op: str, a, b):
    """A rounding division or remainder at the result's dtype. torch takes half-precision ones step
    by step, each step rounded to the half type (c10's div_floor_floating on BFloat16), with a Python
    number operand first rounded to that type; except a division by a Python number, which it takes
    in float32 and rounds once. So do we."""
    dtype = ctx.dtype
    if dtype not in LOW_PRECISION:
        return elementwise(ctx, lambda x, y: call(op, x, y), a, b, upcast_reads=dtype.is_floating_point)
    if op in ("floordiv", "truncdiv") and not isinstance(b, (TensorValue, torch.Tensor)):
        return elementwise(ctx, lambda x, y: call(op, x, y), a, b, upcast_reads=True)
    a, b = (_as_dtype(v, dtype) for v in (a, b))
    return elementwise(ctx, lambda x, y: _half_division(op, x, y, dtype), a, b, upcast_reads=True)


def _as_dtype(v, dtype):
    """A Python number as torch sees it beside a tensor of `dtype`: rounded to it."""
    return v if isinstance(v, (TensorValue, torch.Tensor)) else torch.tensor(v, dtype=dtype).item()


def _half_division(op: str, x, y, dtype):
    def rounded(e):
        return Cast(torch.float32, Cast(dtype, e))

    if op == "truncdiv":
        return call("trunc", rounded(call("div", x, y)))
    m = call("fmod", x, y)  # exact: a remainder of two halves is one
    if op == "fmod":
        return m
    zero = Const(0.0)
    signs_differ = call("and", call("ne", m, zero), call("ne", call("lt", y, zero), call("lt", m, zero)))
    if op == "mod":
        return call("where", signs_differ, rounded(call("add", m, y)), m)
    d = rounded(call("div", rounded(call("sub", x, m)), y))
    d = call("where", signs_differ, rounded(call("sub", d, Const(1.0))), d)
    f = call("floor", d)
    f = call("where", call("gt", rounded(call("sub", d, f)), Const(0.5)), rounded(call("add", f, Const(1.0))), f)
    whole = call("where", call("eq", d, zero), call("mul", d, zero), f)
    return call("where", call("eq", y, zero), call("div", x, y), whole)


def _rounding_division(op: str):
    return lambda ctx, a, b: _division(ctx, op, a, b)


lowering(operator.floordiv, operator.ifloordiv, torch.floor_divide, "method:floor_divide", "aten.floor_divide")(
    _rounding_division("floordiv"))
lowering(operator.mod, operator.imod, torch.remainder, "method:remainder", "aten.remainder")(_rounding_division("mod"))
lowering(torch.fmod, "method:fmod", "aten.fmod")(_rounding_division("fmod"))


def _bitwise(logical: str, bits: str):
    """&, |, ^ on bools are the logical ops; on integers, bitwise."""
    def lower(ctx, a, b):
        op = logical if ctx.dtype == torch.bool else bits
        if ctx.dtype.is_floating_point:
            raise UnsupportedOpError(bits, "bitwise ops take integers or bools", ctx.hint)
        return elementwise(ctx, lambda x, y: call(op, x, y), a, b)

    return lower


for _logical, _bits, _keys in (
    ("and", "bitand", (operator.and_, operator.iand, torch.bitwise_and, "method:bitwise_and", "aten.bitwise_and",
                       "aten.__and__")),
    ("or", "bitor", (operator.or_, operator.ior, torch.bitwise_or, "method:bitwise_or", "aten.bitwise_or",
                     "aten.__or__")),
    ("ne", "bitxor", (operator.xor, operator.ixor, torch.bitwise_xor, "method:bitwise_xor", "aten.bitwise_xor",
                      "aten.__xor__")),
):
    lowering(*_keys)(_bitwise(_logical, _bits))
lowering(torch.logical_xor, "method:logical_xor", "aten.logical_xor")(
    lambda ctx, a, b: elementwise(ctx, lambda x, y: call("ne", call("ne", x, Const(0)), call("ne", y, Const(0))), a, b))


@lowering(operator.invert, torch.bitwise_not, "method:bitwise_not", "aten.bitwise_not")
def lower_bitwise_not(ctx, x):
    if ctx.dtype.is_floating_point:
        raise UnsupportedOpError("bitwise_not", "bitwise ops take integers or bools", ctx.hint)
    return elementwise(ctx, lambda a: call("not" if ctx.dtype == torch.bool else "bitnot", a), x)


def _shift(op: str):
    def lower(ctx, a, b):
        if ctx.dtype.is_floating_point:
            raise UnsupportedOpError("shift", "shifts take integers", ctx.hint)
        return elementwise(ctx, lambda x, y: call(op, x, y), a, b)

    return lower


lowering(operator.lshift, operator.ilshift, torch.bitwise_left_shift, "method:bitwise_left_shift",
         "aten.bitwise_left_shift", "aten.__lshift__")(_shift("shl"))
lowering(operator.rshift, operator.irshift, torch.bitwise_right_shift, "method:bitwise_right_shift",
         "aten.bitwise_right_shift", "aten.__rshift__")(_shift("shr"))


@lowering(torch.relu, F.relu, "method:relu", "aten.relu")
def lower_relu(ctx, x, inplace=False):
    return elementwise(ctx, lambda a: call("relu", a), x)


@lowering(F.gelu, "method:gelu", "aten.gelu")
def lower_gelu(ctx, x, approximate="none"):
    body = BODIES["gelu_tanh" if approximate == "tanh" else "gelu"][1]
    return elementwise(ctx, body, x, tag="gelu", upcast_reads=True)


@lowering(F.silu, "method:silu", "aten.silu")
def lower_silu(ctx, x, inplace=False):
    return elementwise(ctx, BODIES["silu"][1], x, tag="silu", upcast_reads=True)


def _activation(keys, tag: str, formula):
    """Register an activation built from the IR's ops: `formula(a, **options)` at each point, in
    float32 for half-precision inputs; the options are the function's keyword defaults, which
    positional arguments after the input override in order (F.elu(x, 0.5) is alpha=0.5)."""
    names = tuple(formula.__kwdefaults__ or {})

    def lower(ctx, x, *args, inplace=False, **kwargs):
        options = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
        return elementwise(ctx, lambda a: formula(a, **options), x, tag=tag, upcast_reads=True)

    lowering(*keys)(lower)


def _c(v):
    return Const(float(v))


def _softplus(a, *, beta=1.0, threshold=20.0):
    # torch: x where beta * x > threshold (exp would overflow), else log(1 + exp(beta * x)) / beta
    scaled = call("mul", a, _c(beta))
    soft = call("div", call("log", call("add", _c(1.0), call("exp", scaled))), _c(beta))
    return call("where", call("gt", scaled, _c(threshold)), a, soft)


def _hardtanh(a, *, min_val=-1.0, max_val=1.0):
    return call("min", call("max", a, _c(min_val)), _c(max_val))


def _elu(a, *, alpha=1.0):
    return call("where", call("gt", a, _c(0.0)), a, call("mul", _c(alpha), call("sub", call("exp", a), _c(1.0))))


_activation((F.softplus, "aten.softplus"), "softplus", _softplus)
_activation((F.hardtanh, torch._C._nn.hardtanh, "aten.hardtanh"), "hardtanh", _hardtanh)
_activation((F.relu6, torch._C._nn.relu6, "aten.relu6"), "relu6", lambda a: _hardtanh(a, min_val=0.0, max_val=6.0))
_activation((F.hardsigmoid, torch._C._nn.hardsigmoid, "aten.hardsigmoid"), "hardsigmoid",
            lambda a: _hardtanh(call("add", call("div", a, _c(6.0)), _c(0.5)), min_val=0.0, max_val=1.0))
_activation((F.hardswish, torch._C._nn.hardswish, "aten.hardswish"), "hardswish",
            lambda a: call("div", call("mul", a, _hardtanh(call("add", a, _c(3.0)), min_val=0.0, max_val=6.0)), _c(6.0)))
def _aten_elu(a, *, alpha=1.0, scale=1.0, input_scale=1.0):
    # aten.elu's own arguments: AOTAutograd's graphs write F.selu and F.celu through them
    inner = call("mul", _c(alpha), call("sub", call("exp", call("mul", a, _c(input_scale))), _c(1.0)))
    return call("mul", _c(scale), call("where", call("gt", a, _c(0.0)), a, inner))


_activation((F.elu, torch._C._nn.elu), "elu", _elu)  # F.elu(x, alpha, inplace)
_activation(("aten.elu",), "elu", _aten_elu)
_activation((F.leaky_relu, torch._C._nn.leaky_relu, "aten.leaky_relu"), "leaky_relu",
            lambda a, *, negative_slope=0.01: call("where", call("gt", a, _c(0.0)), a, call("mul", a, _c(negative_slope))))
_activation((F.mish, torch._C._nn.mish, "aten.mish"), "mish", lambda a: call("mul", a, call("tanh", _softplus(a))))


@lowering(F.glu, "aten.glu")
def lower_glu(ctx, x, dim=-1):
    """a * sigmoid(b) over the two halves of `dim`, read as views of x."""
    dim = V.norm_dim(dim, x.rank)
    half = x.shape[dim] // 2
    a, b = V.slice_dim(x, dim, 0, half, 1), V.slice_dim(x, dim, half, 2 * half, 1)
    return elementwise(ctx, lambda p, q: call("mul", p, call("sigmoid", q)), a, b, tag="glu", upcast_reads=True)


@lowering(torch.clamp, torch.clip, "method:clamp", "method:clip", "aten.clamp", "aten.clip")
def lower_clamp(ctx, x, min=None, max=None):
    bounds = [(op, b) for op, b in (("max", min), ("min", max)) if b is not None]

    def body(a, *limits):
        for (op, _), limit in zip(bounds, limits):
            a = call(op, a, limit)
        return a

    return elementwise(ctx, body, x, *(b for _, b in bounds))


@lowering(torch.clamp_min, "method:clamp_min", "aten.clamp_min")
def lower_clamp_min(ctx, x, min):
    return elementwise(ctx, lambda a, m: call("max", a, m), x, min)


@lowering(torch.clamp_max, "method:clamp_max", "aten.clamp_max")
def lower_clamp_max(ctx, x, max):
    return elementwise(ctx, lambda a, m: call("min", a, m), x, max)


@lowering("method:where")
def lower_where_method(ctx, x, condition, y):
    """x.where(condition, y) is torch.where(condition, x, y): the tensor is the value, not the condition."""
    return lower_where(ctx, condition, x, y)


@lowering(torch.where, "aten.where")
def lower_where(ctx, cond, a=None, b=None):
    if a is None:
        raise UnsupportedOpError("where", "the one-argument form has a data-dependent shape", ctx.hint)
    return elementwise(ctx, lambda c, x, y: call("where", c, x, y), cond, a, b)


@lowering(torch.masked_fill, "method:masked_fill", "method:masked_fill_", "aten.masked_fill")
def lower_masked_fill(ctx, x, mask, value):
    return elementwise(ctx, lambda a, m, v: call("where", m, v, a), x, mask, value)


def _identity(ctx, x, *args, **kwargs):
    return x


lowering(
    "method:contiguous", "method:clone", "method:detach", "method:cpu", "method:cuda", torch.clone,
    "aten.clone", "aten.contiguous", "aten.alias", "aten.detach", "aten.lift_fresh_copy",
    "aten.detach_",  # torch.export writes a torch.tensor(...) constant as lift_fresh_copy, then detach_
    "method:detach_", "method:requires_grad_",  # registry.VALUES_UNCHANGED: no value is written
)(_identity)


def cast(ctx, x, dtype: torch.dtype):
    if not isinstance(x, TensorValue) or x.dtype == dtype:
        return x
    return elementwise(ctx, lambda a: Cast(dtype, a), x)


@lowering("method:to", "aten._to_copy", "aten.to",
          "aten.convert_element_type")  # (prims': a float argument made a tensor under dynamic shapes)
@takes_complex
def lower_to(ctx, x, *args, **kwargs):
    if ctx.dtype.is_complex:  # a real tensor made complex (AOTAutograd's graphs, before a Fourier transform)
        real = ctx.dtype.to_real()
        if isinstance(x, ComplexValue) and x.real.dtype == real:
            return x
        if isinstance(x, TensorValue):
            return ComplexValue(cast(sub_ctx(ctx, x.shape, real, "real"), x, real), None)
        raise UnsupportedOpError("to", f"{ctx.dtype} from {getattr(x, 'real', x).dtype}", ctx.hint)
    if isinstance(x, ComplexValue):
        raise UnsupportedOpError("to", f"a complex value to {ctx.dtype} (its imaginary part dropped)", ctx.hint)
    return cast(ctx, x, ctx.dtype)


@lowering(
    "method:float", "method:double", "method:half", "method:bfloat16", "method:type_as",
    "method:long", "method:int", "method:short", "method:bool",
    "method:type", "aten.type_as", "aten._assert_tensor_metadata",
)
def lower_cast_methods(ctx, x, *args, **kwargs):
    if not isinstance(ctx.out, torch.Tensor):
        return None
    return cast(ctx, x, ctx.dtype)
