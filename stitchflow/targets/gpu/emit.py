"""Emitting Triton source for node bodies: loads with address arithmetic, scalar ops, casts.

Values are named temporaries in the generated source. Each carries its kind ('f' float, 'i'
int, 'b' bool) and the tile axes it varies along ('p' parallel, 'l' local), so masks and
broadcasts are only emitted where they are needed. Half-precision data is computed in float32
and rounded to the node's dtype after each node, as eager PyTorch rounds after each op.
"""

from __future__ import annotations

import ast

from ...ir.errors import TargetError

import math
import re
from dataclasses import dataclass

import torch

from ...ir.expr import OPS, Call, Cast, Const, IndexValue, Read, substitute_expr
from ...ir.index import Div, Gather, Lit, Mod, Sum, Var, bounds, gathered_tensors, rename
from ...ir.types import LOW_PRECISION
from .analysis import register_read


def contiguous_strides(shape) -> tuple[int, ...]:
    """Row-major strides of `shape`, in elements."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


TL_DTYPE = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64", torch.int64: "tl.int64", torch.int32: "tl.int32", torch.int16: "tl.int16",
    torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}

UNARY_FLOAT = {"exp": "tl.exp", "log": "tl.log", "sqrt": "tl.sqrt_rn", "rsqrt": "tl.rsqrt",
               "sigmoid": "tl.sigmoid", "erf": "tl.erf", "sin": "tl.sin", "cos": "tl.cos", "floor": "tl.floor",
               "ceil": "tl.ceil", "round": "_round_even", "log1p": "_log1p", "expm1": "_expm1", "trunc": "_trunc"}
BITWISE = {"bitand": "&", "bitor": "|", "bitxor": "^", "shl": "<<", "shr": ">>"}
ROUNDING_DIVISIONS = ("floordiv", "truncdiv", "mod", "fmod")


@dataclass(frozen=True)
class Val:
    code: str
    kind: str  # 'f' | 'i' | 'b'
    deps: frozenset  # subset of {'p', 'l'}


def kind_of(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "b"
    return "f" if dtype.is_floating_point else "i"


def carried(code: str, dtype: torch.dtype, interpret: bool = False) -> str:
    """A value rounded to `dtype` and carried at compute precision (float32 for halves)."""
    if dtype in LOW_PRECISION:
        return f"{to_dtype(code, dtype, interpret)}.to(tl.float32)"
    if dtype == torch.bool:
        return code
    return to_dtype(code, dtype, interpret)


def to_dtype(code: str, dtype: torch.dtype, interpret: bool = False) -> str:
    """Conversion with round-to-nearest-even for half types, as the GPU does by default. The
    interpreter truncates to bfloat16 (and its 'rtne' drops the carry), so there the rounding
    is done on the bits first, after which the conversion is exact."""
    if dtype == torch.bfloat16 and interpret:
        return f"_round_bf16({code}.to(tl.float32)).to(tl.bfloat16)"
    return f"{code}.to({TL_DTYPE[dtype]})"


class Source:
    """Lines of generated code with indentation and fresh temporary names."""

    def __init__(self):
        self.lines: list[str] = []
        self.depth = 1
        self.count = 0

    def tmp(self, prefix: str = "t") -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def emit(self, text: str) -> None:
        self.lines.append("    " * self.depth + text)

    def let(self, code: str, prefix: str = "t") -> str:
        name = self.tmp(prefix)
        self.emit(f"{name} = {code}")
        return name


class Scope:
    """Memo of emitted values; a chunk scope falls back to the program-level (row) scope."""

    def __init__(self, parent: "Scope | None" = None, chunk: bool = False):
        self.parent = parent
        self.chunk = chunk
        self.values: dict = {}

    def get(self, key):
        if key in self.values:
            return self.values[key]
        return self.parent.get(key) if self.parent else None


class BodyEmitter:
    """Emits the values of node bodies for one part; the kernel builder supplies coordinates,
    masks, argument names, strides and the values of intermediate nodes."""

    def __init__(self, kernel, interpret: bool):
        self.k = kernel  # the PartKernel (codegen.py): coords, masks, node values
        self.interpret = interpret
        self.summing = False  # emitting the body of a sum reduction (see _unary_float)
        self.log: list | None = None  # when a list, every load emitted is recorded (prefetching)

    # ------------------------------------------------------------ index arithmetic
    def index(self, e, node, scope: Scope) -> Val:
        if isinstance(e, Var):
            return self.k.coord(self.k.plan.cls[(node.name, e.name)], scope)
        if isinstance(e, Lit):  # (a literal, as const writes it: a cast rounds it here, a number has no .to())
            return const(int(e.value))
        if isinstance(e, Sum):
            parts, deps = [], frozenset()
            for c, a in e.terms:
                v = self.index(a, node, scope)
                deps |= v.deps
                parts.append(v.code if c == 1 else f"{c} * {v.code}")
            if e.const:
                parts.append(str(e.const))
            return Val("(" + " + ".join(parts) + ")", "i", deps)
        if isinstance(e, (Div, Mod)):
            v = self.index(e.arg, node, scope)
            op, k = ("//", e.divisor) if isinstance(e, Div) else ("%", e.modulus)
            if isinstance(e, Mod) and gathered_tensors(e.arg):  # data may be negative: the floor's remainder
                return Val(f"((({v.code} % {k}) + {k}) % {k})", "i", v.deps)
            return Val(f"({v.code} {op} {k})", "i", v.deps)
        if isinstance(e, Gather):
            return self.load(e.tensor, e.indices, node, scope, as_index=True)
        raise TypeError(f"unknown index expression {e!r}")

    def offset(self, tensor: str, indices, node, scope: Scope, checks: list | None = None) -> Val:
        """Address of tensor[indices]. Concatenations read out of range under a `where` that
        discards the value; with `checks` those reads are masked (a range test per index,
        appended to `checks`), which keeps the address contiguous along the tile so loads
        stay vectorized; without, the index is clamped as the IR says."""
        shape = self.k.graph.type_of[tensor].shape
        strides = self.k.strides[tensor]
        linear = self._linear_runs(indices, shape, strides, node)
        if linear is not None:
            return self._run_offset(*linear, scope)
        terms, deps = [], frozenset()
        runs, merged = self._contiguous_runs(indices, shape, strides, node)
        for (outer, inner), stride in runs:
            v = self.k.coord_run(outer, inner, scope)
            deps |= v.deps
            terms.append(v.code if stride == 1 else f"{v.code} * {stride}")
        for k, (idx, size, stride) in enumerate(zip(indices, shape, strides)):
            if k in merged:
                continue
            v = self.index(idx, node, scope)
            lo, hi = bounds(idx, node.extents)
            if gathered_tensors(idx):  # a gathered index is data: it may be negative too
                lo = min(lo, -1)
            code = v.code
            if checks is not None and (hi > size - 1 or lo < 0):
                if hi > size - 1:
                    checks.append(f"({code} < {size})")
                if lo < 0:
                    checks.append(f"({code} >= 0)")
                if size == 1:  # the checks vary along the tile: so must the address (in range, the term is 0)
                    deps |= v.deps
                    terms.append(code if stride == 1 else f"{code} * {stride}")
                    continue
            else:
                if hi > size - 1:
                    code = f"tl.minimum({code}, {size - 1})"
                if lo < 0:
                    code = f"tl.maximum({code}, 0)"
            if size > 1 and code != "0":  # a dim of one adds nothing to the address, nor a tile axis to vary along
                deps |= v.deps
                terms.append(code if stride == 1 else f"{code} * {stride}")
        return Val(" + ".join(terms) if terms else "0", "i", deps)

    def _run_offset(self, runs: list, const: int, scope: Scope) -> Val:
        terms, deps = [], frozenset()
        for (outer, inner), stride in runs:
            v = self.k.coord_run(outer, inner, scope)
            deps |= v.deps
            terms.append(v.code if stride == 1 else f"{v.code} * {stride}")
        if const:
            terms.append(str(const))
        return Val(" + ".join(terms) if terms else "0", "i", deps)

    def _linear_runs(self, indices, shape, strides, node) -> tuple[list, int] | None:
        """The address as runs of tile axis classes when an index adds several of them, as a view does: group
        norm reads x[i, 16·j + l, m, n] over classes (i, j | l, m, n), which is p·65536 + l, one coordinate per
        tile axis, where index by index it took a div and a mod per axis and lost the loads' contiguity. The
        address must be affine in the classes' coordinates, every index in range (no clamp or mask), and each
        variable span its whole class. Returns ([((outer, inner), stride)], constant) or None (index by
        index)."""
        plan = self.k.plan
        if self.k.planes is not None or not any(isinstance(i, Sum) and len(i.terms) > 1 for i in indices):
            return None
        coef: dict[int, int] = {}
        const = 0
        for idx, size, stride in zip(indices, shape, strides):
            lo, hi = bounds(idx, node.extents)
            if lo < 0 or hi > size - 1:
                return None
            if isinstance(idx, Lit):
                const += idx.value * stride
                continue
            terms = idx.terms if isinstance(idx, Sum) else ((1, idx),)
            const += (idx.const if isinstance(idx, Sum) else 0) * stride
            for c, a in terms:
                cls = plan.cls.get((node.name, a.name)) if isinstance(a, Var) else None
                if cls is None or node.extents.get(a.name) != plan.extents[cls]:
                    return None
                coef[cls] = coef.get(cls, 0) + c * stride
        if any(c not in plan.P and c not in plan.L for c in coef):
            return None
        runs = []
        for group in (plan.P, plan.L):
            i = 0
            while i < len(group):
                if not coef.get(group[i]) or plan.extents[group[i]] == 1:
                    i += 1
                    continue
                j = i
                while (j + 1 < len(group) and coef.get(group[j + 1])
                       and coef[group[j]] == plan.extents[group[j + 1]] * coef[group[j + 1]]):
                    j += 1
                runs.append(((group[i], group[j]), coef[group[j]]))
                i = j + 1
        return runs, const

    def _contiguous_runs(self, indices, shape, strides, node) -> tuple[list, set]:
        """Runs of adjacent axes of one tile axis that the tensor lays out contiguously (stride of
        the outer = extent of the inner x stride of the inner), e.g. batch norm's H and W: each run
        addresses as one coordinate, (flat // inner) % extent, instead of one div/mod pair per axis
        (with 64 elements per thread the per-axis index math made ptxas spill). Returns
        [((outer class, inner class), stride of the inner)] and the merged index positions."""
        plan = self.k.plan
        groups = {"p": plan.P, "l": plan.L}
        place = {}  # (tile axis, position in it) -> position in `indices`
        for k, (idx, size) in enumerate(zip(indices, shape)):
            if isinstance(idx, Var) and size > 1:
                c = plan.cls[(node.name, idx.name)]
                if plan.extents[c] == size:  # no clamping
                    axis = "p" if c in plan.P else "l"
                    place[(axis, groups[axis].index(c))] = k
        runs, merged = [], set()
        for (axis, i), k in sorted(place.items(), key=lambda item: item[0][1]):
            if k in merged:
                continue
            run, group = [k], groups[axis]
            while (axis, i + len(run)) in place:
                nxt = place[(axis, i + len(run))]
                if strides[run[-1]] != plan.extents[group[i + len(run)]] * strides[nxt]:
                    break
                run.append(nxt)
            if len(run) > 1:
                runs.append(((group[i], group[i + len(run) - 1]), strides[run[-1]]))
                merged.update(run)
        return runs, merged

    def load(self, tensor: str, indices, node, scope: Scope, as_index: bool = False) -> Val:
        key = self.load_key(tensor, indices, node)
        found = scope.get(key)
        if found is not None:
            return found
        code, deps = self.raw_load(tensor, indices, node, scope)
        if self.log is not None:
            self.log.append((key, tensor, indices, node, deps))
        dtype = self.k.graph.type_of[tensor].dtype
        if dtype in LOW_PRECISION:
            code += ".to(tl.float32)"
        val = Val(self.k.src.let(code, "x"), kind_of(dtype), deps)
        scope.values[key] = val
        return val

    def load_key(self, tensor: str, indices, node) -> tuple:
        return ("load", tensor, tuple(rename(i, self.k.canonical_names(node)) for i in indices))

    def raw_address(self, tensor: str, indices, node, scope: Scope) -> tuple[str, str | None, frozenset]:
        """(pointer, mask or None, tile axes it varies along) of tensor[indices]."""
        checks: list = []
        off = self.offset(tensor, indices, node, scope, checks)
        mask = self.k.mask(off.deps, scope)
        if checks:  # out-of-range lanes read 0 (their values are discarded)
            mask = self.k.src.let(" & ".join(([mask] if mask else []) + checks), "m")
        pointer = f"{self.k.arg[tensor]} + {off.code}" if off.code != "0" or mask else self.k.arg[tensor]
        return pointer, mask, off.deps

    def raw_load(self, tensor: str, indices, node, scope: Scope) -> tuple[str, frozenset]:
        """`tl.load(...)` of tensor[indices] in the tensor's own dtype, and the tile axes it
        varies along."""
        pointer, mask, deps = self.raw_address(tensor, indices, node, scope)
        hint = f", eviction_policy='{self.k.load_hint}'" if self.k.load_hint and "l" in deps else ""
        if mask and any(_divides(i) for i in indices):
            # Triton 3.6 on an H100 took a masked 8-byte load whose address repeats along the tile (a
            # max-pool gradient's x[.., w // 2]) with the mask of its neighbour: at one or two warps the
            # last column of a ceil-mode pool read 0 (scripts/triton_div_probe.py). The address is
            # clamped into the tensor instead and the value masked, which that pattern gets right.
            if self.k.mask(deps, scope) is None:
                # no lane lies past the iteration space: each index clamped into its dimension keeps the
                # address contiguous along the tile, so the loads stay vectorized (ResNet-18's unrolled
                # stem pool gradient, channels last: 662 µs with whole addresses clamped, 130 with each index)
                clamped = f"{self.k.arg[tensor]} + {self.offset(tensor, indices, node, scope).code}"
            else:
                last = sum((n - 1) * st for n, st in zip(self.k.graph.type_of[tensor].shape, self.k.strides[tensor]))
                base, _, off = pointer.partition(" + ")
                clamped = f"{base} + tl.minimum(tl.maximum({off or '0'}, 0), {last})"
            loaded = self.k.src.let(f"tl.load({clamped}{hint})", "x")
            return f"tl.where({mask}, {loaded}, tl.zeros_like({loaded}))", deps
        mask_arg = f", mask={mask}, other=0" if mask else ""
        return f"tl.load({pointer}{mask_arg}{hint})", deps

    # ------------------------------------------------------------ bodies
    def expr(self, e, node, scope: Scope, inlining: bool = False, result: torch.dtype | None = None) -> Val:
        """The value of body `e` of `node`; `result` is the dtype the enclosing node rounds
        to (the node's own, or an inlined producer's), which picks special-function variants."""
        result = result or self.k.graph.type_of[node.name].dtype
        if isinstance(e, Const):
            return const(e.value)
        if isinstance(e, Read):
            a = e.access
            if a.tensor in self.k.group_names:
                if a.tensor in self.k.node_names and not inlining and register_read(self.k.graph, node, a):
                    return self.k.node_value(a.tensor, scope)
                return self.inline(self.k.graph.node_of[a.tensor], a.indices, node, scope)
            return self.load(a.tensor, a.indices, node, scope)
        if isinstance(e, IndexValue):
            return self.index(e.index, node, scope)
        if isinstance(e, Cast):
            if isinstance(e.arg, Const):
                return const(torch.tensor(e.arg.value).to(e.dtype).item())
            return self.cast(self.expr(e.arg, node, scope, inlining, result), e.dtype)
        if isinstance(e, Call):
            if all(isinstance(a, Const) for a in e.args):
                return const(_fold(e))
            return self.call(e.op, [self.expr(a, node, scope, inlining, result) for a in e.args], e.args, result)
        raise TypeError(f"unknown expression {e!r}")

    def inline(self, producer, indices, node, scope: Scope) -> Val:
        """The producer's body evaluated at the consumer's indices, rounded to its dtype."""
        body = inline_body(producer, indices, node.extents)
        v = self.expr(body, node, scope, inlining=True, result=self.k.graph.type_of[producer.name].dtype)
        return self.cast(v, self.k.graph.type_of[producer.name].dtype)

    def cast(self, v: Val, dtype: torch.dtype) -> Val:
        if is_literal(v):  # a constant producer (torch.ones, a -inf mask fill) inlined: rounded here, a number
            return const(torch.tensor(literal_value(v)).to(dtype).item())
        if dtype == torch.bool:
            return v if v.kind == "b" else Val(self.k.src.let(f"({v.code} != 0)"), "b", v.deps)
        return Val(self.k.src.let(carried(v.code, dtype, self.interpret)), kind_of(dtype), v.deps)

    def call(self, op: str, args: list[Val], raw, result: torch.dtype = torch.float32) -> Val:
        if args and all(is_literal(a) for a in args):  # (an index's literal: the IR's constants fold in expr)
            return const(_fold(Call(op, tuple(Const(literal_value(a)) for a in args))))
        deps = frozenset().union(*(a.deps for a in args))
        kind_op = OPS[op].kind
        if kind_op == "compare":
            return self._let(f"({args[0].code} {OPS[op].infix} {args[1].code})", "b", deps)
        if kind_op == "logic":
            bools = [a.code if a.kind == "b" else f"({a.code} != 0)" for a in args]
            text = f"({bools[0]} == 0)" if op == "not" else f"({bools[0]} {OPS[op].infix} {bools[1]})"
            if op != "not" and bool(args[0].deps) != bool(args[1].deps):
                # a scalar's truth beside a tile's as a select: Triton's interpreter refuses `tile & scalar` of
                # booleans (a scalar tensor's comparison), the compiler takes either
                scalar, tile = bools if not args[0].deps else bools[::-1]
                text = f"tl.where({scalar}, {tile}, False)" if op == "and" else f"tl.where({scalar}, True, {tile})"
            return self._let(text, "b", deps)
        if op == "where":
            c, a, b = args
            cond = c.code if c.kind == "b" else f"({c.code} != 0)"
            return self._let(f"tl.where({cond}, {a.code}, {b.code})", _promote(a, b), deps)
        args = [_as_int(a) if a.kind == "b" else a for a in args]
        if kind_op == "bits":
            return self._bits(op, args, deps, result)
        if op in ROUNDING_DIVISIONS:
            return self._rounding_division(op, args, deps)
        if op in UNARY_FLOAT or op == "tanh":
            (a,) = args
            x = _as_float(a)
            return self._let(self._unary_float(op, x, result), "f", deps)
        if op == "pow":
            return self._pow(args[0], args[1], raw[1], deps)
        if op == "atan2":
            return self._let("_atan2({0}, {1})".format(*_float_tiles(*args)), "f", deps)
        if op in ("rand", "randn"):  # Philox, as the reference computes it (ir/random.py)
            seed, offset = args
            counter = f"tl.full([], {offset.code}, tl.int32)" if is_literal(offset) else offset.code  # (a block)
            return self._let(f"tl.{op}({seed.code}, {counter})", "f", deps)
        kind = "f" if op == "div" else _promote(*args)
        a = args[0].code
        if op in ("add", "sub", "mul", "div"):
            return self._let(f"({a} {OPS[op].infix} {args[1].code})", kind, deps)
        if op in ("max", "min"):  # torch.maximum and minimum keep a NaN (float operands only have one)
            fn = "tl.maximum" if op == "max" else "tl.minimum"
            nan = ", propagate_nan=tl.PropagateNan.ALL" if kind == "f" else ""
            return self._let(f"{fn}({a}, {args[1].code}{nan})", kind, deps)
        if op == "neg":  # Triton negates as 0 - x, which gives +0 for 0; torch.neg(0.0) is -0.0
            return self._let(f"({a} * -1.0)" if kind == "f" else f"(-{a})", kind, deps)
        if op == "abs":
            return self._let(f"tl.abs({a})", kind, deps)
        if op == "relu":  # relu(NaN) is NaN in torch
            nan = ", propagate_nan=tl.PropagateNan.ALL" if kind == "f" else ""
            return self._let(f"tl.maximum({a}, 0{nan})", kind, deps)
        if op == "recip":
            return self._let(f"(1.0 / {a})", "f", deps)
        raise TargetError(f"scalar op {op} has no Triton lowering")

    def _bits(self, op: str, args: list[Val], deps, result: torch.dtype) -> Val:
        if op == "bitnot":
            return self._let(f"(~{args[0].code})", "i", deps)
        a, b = args[0].code, args[1].code
        if op not in ("shl", "shr"):
            return self._let(f"({a} {BITWISE[op]} {b})", "i", deps)
        # torch: a shift by a negative amount or by the width or more gives 0 (or -1 for a negative a
        # shifted right); the device's shift is undefined there
        width = 64 if result.is_floating_point or result == torch.bool else torch.iinfo(result).bits
        beyond = f"tl.where({a} < 0, -1, 0)" if op == "shr" else "0"
        return self._let(f"tl.where(({b} >= 0) & ({b} < {width}), {a} {BITWISE[op]} {b}, {beyond})", "i", deps)

    def _rounding_division(self, op: str, args: list[Val], deps) -> Val:
        """torch's floor and truncating divisions and remainders: integers with C's / and % corrected
        toward the floor; floats from an exact fmod, as torch computes them."""
        a, b = args
        if a.kind == "i" and b.kind == "i":
            text = {"floordiv": "_floordiv_int({0}, {1})", "mod": "_mod_int({0}, {1})",
                    "truncdiv": "({0} // {1})", "fmod": "({0} % {1})"}[op]
            return self._let(text.format(a.code, b.code), "i", deps)
        x, y = _float_tiles(a, b)
        if op == "truncdiv":
            return self._let(f"_trunc({x} / {y})", "f", deps)
        # libdevice's fmod (exact) returns nothing under the interpreter, which takes the float64 version
        m = self._let(f"_fmod_f64({x}, {y})" if self.interpret else f"libdevice.fmod({x}, {y})", "f", deps)
        if op == "fmod":
            return m
        if op == "mod":
            return self._let(f"_mod_from_fmod({m.code}, {y})", "f", deps)
        return self._let(f"_floordiv_from_fmod({x}, {y}, {m.code})", "f", deps)

    def _unary_float(self, op: str, x: str, result: torch.dtype) -> str:
        if op == "erf" and result in LOW_PRECISION:  # see codegen's _erf_lowp: error far below the rounding
            return f"_erf_lowp({x})"
        if op == "exp" and (self.summing or result in LOW_PRECISION):
            # ex2.approx with flush-to-zero: tl.exp's denormal fix-ups cost three instructions
            # per element. Only results under 2^-126 change (to 0): invisible in a sum of
            # exponentials (a softmax's has a term of 1) and in a half-precision result.
            return f"_ex2_approx({x} * 1.4426950408889634)"
        if op == "sqrt" and result == torch.float64:
            return f"tl.sqrt({x})"  # sqrt_rn is float32's; float64's square root is correctly rounded anyway
        if op != "tanh":
            return f"{UNARY_FLOAT[op]}({x})"
        return f"_tanh({x})"

    def _pow(self, base: Val, expo: Val, raw_expo, deps) -> Val:
        value = raw_expo.value if isinstance(raw_expo, Const) else None
        b = base.code
        if value in (1, 2, 3, 4) and float(value).is_integer():
            return self._let("(" + " * ".join([b] * int(value)) + ")", base.kind, deps)
        if value is not None and float(value).is_integer() and abs(value) <= 64 and (value >= 0 or base.kind == "f"):
            return self._integer_power(base, int(value), deps)
        if value == 0.5:
            return self._let(f"tl.sqrt_rn({b})", "f", deps)
        x = _as_float(base)
        if self.interpret:
            return self._let(f"tl.exp({expo.code} * tl.log({x}))", "f", deps)
        return self._let(f"libdevice.pow({x}, {expo.code})", "f", deps)

    def _integer_power(self, base: Val, n: int, deps) -> Val:
        """b ** n for a whole n by squaring: exact for integers (through float32 99 ** 5 was off by 211),
        a negative base keeps its sign, and b ** 0 is 1 even for NaN, as in torch (exp(n log b) is NaN
        for b < 0: the interpreter's form of pow)."""
        if n == 0:
            one = "1.0" if base.kind == "f" else "1"
            return self._let(f"tl.where({base.code} == {base.code}, {one}, {one})", base.kind, deps)
        result, square, k = None, base.code, abs(n)
        while k:
            if k & 1:
                result = square if result is None else self.k.src.let(f"({result} * {square})")
            k >>= 1
            if k:
                square = self.k.src.let(f"({square} * {square})")
        return self._let(f"(1.0 / {result})" if n < 0 else result, base.kind, deps)

    def _let(self, code: str, kind: str, deps) -> Val:
        return Val(self.k.src.let(code), kind, frozenset(deps))


def spread_address(off: Val, value: Val) -> Val:
    """The address of a block stored where the address spans fewer tile axes than the value (a 0-d output):
    the lanes share it."""
    if not value.deps - off.deps:
        return off
    spread = " + ".join(f"0 * {d}" for d in sorted(value.deps - off.deps))
    return Val(f"{off.code} + {spread}", off.kind, off.deps | value.deps)


def _divides(e) -> bool:
    """Whether index `e` holds a floor division or a remainder (its address repeats or wraps)."""
    if isinstance(e, (Div, Mod)):
        return True
    if isinstance(e, Sum):
        return any(_divides(a) for _, a in e.terms)
    if isinstance(e, Gather):
        return any(_divides(i) for i in e.indices)
    return False


def inline_body(producer, indices, ranges):
    """Substitute a read's index expressions for the producer's output variables."""
    return substitute_expr(producer.body, dict(zip(producer.out_vars, indices)), ranges)


def _float_tiles(a: Val, b: Val) -> tuple[str, str]:
    """Both operands as floats; the helpers compare, combine and convert them, so a constant or a
    scalar comes in the other operand's tile shape."""
    x, y = _as_float(a), _as_float(b)
    if is_literal(a) or (not a.deps and b.deps):
        x = f"(tl.zeros_like({y}) + {x})"
    elif is_literal(b) or (not b.deps and a.deps):
        y = f"(tl.zeros_like({x}) + {y})"
    return x, y


def _as_float(v: Val) -> str:
    if v.kind == "f":
        return v.code
    if is_literal(v):  # an integer or boolean constant
        return f"({float(literal_value(v))!r})"
    return f"{v.code}.to(tl.float32)"


def _as_int(v: Val) -> Val:
    """A boolean as an integer (0 or 1) for arithmetic."""
    return const(int(literal_value(v))) if is_literal(v) else Val(f"{v.code}.to(tl.int32)", "i", v.deps)


NAMED_CONSTANTS = {"INF": float("inf"), "NEG_INF": float("-inf"), "NAN": float("nan")}


NUMBER_TEXT = re.compile(r"\(-?\d+(\.\d*)?([eE][-+]?\d+)?\)")


def is_literal(v: Val) -> bool:
    """A constant, as `const` writes one: a parenthesized number, True or False, or a named infinity or
    NaN (a constexpr in the kernel, which has no .to()); not a scalar's expression, which has no tile
    dependence either (`(x5 < (0.3))` of a scalar load)."""
    return not v.deps and (NUMBER_TEXT.fullmatch(v.code) is not None or v.code in NAMED_CONSTANTS
                           or v.code in ("True", "False"))


def literal_value(v: Val) -> float | int | bool:
    return NAMED_CONSTANTS[v.code] if v.code in NAMED_CONSTANTS else ast.literal_eval(v.code)


def _promote(*vals: Val) -> str:
    kinds = {v.kind for v in vals}
    return "f" if "f" in kinds else "i"


def const(value) -> Val:
    if isinstance(value, bool):
        return Val(str(value), "b", frozenset())
    if isinstance(value, float):
        if math.isnan(value):
            return Val("NAN", "f", frozenset())
        if math.isinf(value):
            return Val("INF" if value > 0 else "NEG_INF", "f", frozenset())
        return Val(f"({value!r})", "f", frozenset())
    return Val(f"({int(value)})", "i", frozenset())


def _fold(e: Call):
    args = [torch.tensor(a.value) for a in e.args]
    out = OPS[e.op].fn(*args)
    return out.item() if isinstance(out, torch.Tensor) else out
