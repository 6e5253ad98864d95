"""Elementwise bodies of index-notation expressions.

A body is a small tree over tensor reads and constants. `OPS` is the one table of scalar
operators: each target maps these names to its own primitives (dataflow ALUs, Triton calls),
and the reference interpreter evaluates them with torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Union

import torch

from .index import IndexExpr, Var, free_vars, gathered_tensors, substitute
from . import random


@dataclass(frozen=True)
class Access:
    tensor: str
    indices: tuple[IndexExpr, ...]

    def __str__(self) -> str:
        return f"{self.tensor}[{','.join(map(str, self.indices))}]"

    @property
    def vars(self) -> frozenset[str]:
        return frozenset().union(*(free_vars(i) for i in self.indices))

    @property
    def is_plain(self) -> bool:
        """Every index is a distinct bare variable (a permutation, no arithmetic)."""
        if not all(isinstance(i, Var) for i in self.indices):
            return False
        return len({i.name for i in self.indices}) == len(self.indices)

    @property
    def tensors(self) -> frozenset[str]:
        return frozenset({self.tensor}).union(*(gathered_tensors(i) for i in self.indices))


@dataclass(frozen=True)
class Read:
    access: Access

    def __str__(self) -> str:
        return str(self.access)


@dataclass(frozen=True)
class Const:
    value: float | int | bool

    def __str__(self) -> str:
        if isinstance(self.value, float) and math.isinf(self.value):
            return "inf" if self.value > 0 else "-inf"
        return repr(self.value)


@dataclass(frozen=True)
class Call:
    op: str
    args: tuple["Expr", ...]

    def __post_init__(self):
        spec = OPS.get(self.op)
        if spec is None:
            raise ValueError(f"unknown scalar op {self.op!r}")
        if spec.arity != len(self.args):
            raise ValueError(f"op {self.op} takes {spec.arity} operands, got {len(self.args)}")

    def __str__(self) -> str:
        spec = OPS[self.op]
        if spec.infix:
            return "(" + f" {spec.infix} ".join(map(str, self.args)) + ")"
        return f"{self.op}({', '.join(map(str, self.args))})"


@dataclass(frozen=True)
class Cast:
    dtype: torch.dtype
    arg: "Expr"

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}({self.arg})"


@dataclass(frozen=True)
class IndexValue:
    """The value of an index expression at the current point (an iota), e.g. for concatenation."""

    index: IndexExpr

    def __str__(self) -> str:
        return f"idx({self.index})"


Expr = Union[Read, Const, Call, Cast, IndexValue]


@dataclass(frozen=True)
class OpSpec:
    arity: int
    fn: Callable
    infix: str = ""
    kind: str = "arith"  # arith | compare | logic | select | bits (integers only)


def _t(x, like=None):
    return x if isinstance(x, torch.Tensor) else torch.tensor(x)


def _maximum(a, b):
    if not isinstance(b, torch.Tensor):
        return torch.clamp(a, min=b) if isinstance(a, torch.Tensor) else max(a, b)
    if not isinstance(a, torch.Tensor):
        return torch.clamp(b, min=a)
    return torch.maximum(a, b)


def _minimum(a, b):
    if not isinstance(b, torch.Tensor):
        return torch.clamp(a, max=b) if isinstance(a, torch.Tensor) else min(a, b)
    if not isinstance(a, torch.Tensor):
        return torch.clamp(b, max=a)
    return torch.minimum(a, b)


def _atan2(y, x):
    if not isinstance(y, torch.Tensor):
        y = torch.full_like(x, y) if isinstance(x, torch.Tensor) else torch.tensor(y)
    return torch.atan2(y, x if isinstance(x, torch.Tensor) else torch.full_like(y, x))


def _where(c, a, b):
    return torch.where(_t(c).bool(), a, b)


def _unary(fn):
    return lambda a: fn(_t(a))


OPS: dict[str, OpSpec] = {
    "add": OpSpec(2, lambda a, b: a + b, "+"),
    "sub": OpSpec(2, lambda a, b: a - b, "-"),
    "mul": OpSpec(2, lambda a, b: a * b, "*"),
    "div": OpSpec(2, lambda a, b: a / b, "/"),
    "pow": OpSpec(2, lambda a, b: _t(a) ** b, "**"),
    "max": OpSpec(2, _maximum),
    "min": OpSpec(2, _minimum),
    "lt": OpSpec(2, lambda a, b: a < b, "<", "compare"),
    "le": OpSpec(2, lambda a, b: a <= b, "<=", "compare"),
    "gt": OpSpec(2, lambda a, b: a > b, ">", "compare"),
    "ge": OpSpec(2, lambda a, b: a >= b, ">=", "compare"),
    "eq": OpSpec(2, lambda a, b: a == b, "==", "compare"),
    "ne": OpSpec(2, lambda a, b: a != b, "!=", "compare"),
    "and": OpSpec(2, lambda a, b: _t(a).bool() & _t(b).bool(), "&", "logic"),
    "or": OpSpec(2, lambda a, b: _t(a).bool() | _t(b).bool(), "|", "logic"),
    "not": OpSpec(1, lambda a: ~_t(a).bool(), kind="logic"),
    "neg": OpSpec(1, lambda a: -a),
    "abs": OpSpec(1, _unary(torch.abs)),
    "exp": OpSpec(1, _unary(torch.exp)),
    "log": OpSpec(1, _unary(torch.log)),
    "sqrt": OpSpec(1, _unary(torch.sqrt)),
    "rsqrt": OpSpec(1, _unary(torch.rsqrt)),
    "recip": OpSpec(1, _unary(torch.reciprocal)),
    "tanh": OpSpec(1, _unary(torch.tanh)),
    "sigmoid": OpSpec(1, _unary(torch.sigmoid)),
    "erf": OpSpec(1, _unary(torch.erf)),
    "relu": OpSpec(1, _unary(torch.relu)),
    "sin": OpSpec(1, _unary(torch.sin)),
    "cos": OpSpec(1, _unary(torch.cos)),
    "floor": OpSpec(1, _unary(torch.floor)),
    "ceil": OpSpec(1, _unary(torch.ceil)),
    "round": OpSpec(1, _unary(torch.round)),  # half to even, as torch.round
    "log1p": OpSpec(1, _unary(torch.log1p)),
    "expm1": OpSpec(1, _unary(torch.expm1)),
    "trunc": OpSpec(1, _unary(torch.trunc)),
    "atan2": OpSpec(2, _atan2),  # the angle of (x, y): atan2(y, x), in (-pi, pi], signed zeros as C's
    # torch's integer and rounding divisions: floordiv rounds the quotient down and mod takes the divisor's sign
    # (Python's // and %), truncdiv rounds toward zero and fmod takes the dividend's sign (C's / and %)
    "floordiv": OpSpec(2, lambda a, b: torch.div(_t(a), b, rounding_mode="floor"), "//"),
    "truncdiv": OpSpec(2, lambda a, b: torch.div(_t(a), b, rounding_mode="trunc")),
    "mod": OpSpec(2, lambda a, b: torch.remainder(_t(a), b), "%"),
    "fmod": OpSpec(2, lambda a, b: torch.fmod(_t(a), b)),
    "bitand": OpSpec(2, lambda a, b: torch.bitwise_and(_t(a), b), kind="bits"),
    "bitor": OpSpec(2, lambda a, b: torch.bitwise_or(_t(a), b), kind="bits"),
    "bitxor": OpSpec(2, lambda a, b: torch.bitwise_xor(_t(a), b), "^", "bits"),
    "bitnot": OpSpec(1, lambda a: torch.bitwise_not(_t(a)), kind="bits"),
    "shl": OpSpec(2, lambda a, b: torch.bitwise_left_shift(_t(a), b), "<<", "bits"),
    "shr": OpSpec(2, lambda a, b: torch.bitwise_right_shift(_t(a), b), ">>", "bits"),
    "where": OpSpec(3, _where, kind="select"),
    # counter-based random numbers (ir/random.py): a float32 per (seed, offset), the same on every target
    "rand": OpSpec(2, lambda seed, offset: random.uniform(seed, offset)),
    "randn": OpSpec(2, lambda seed, offset: random.normal(seed, offset)),
}


def reads(e: Expr) -> tuple[Access, ...]:
    """Every access in the body, in left-to-right order (duplicates kept)."""
    if isinstance(e, Read):
        return (e.access,)
    if isinstance(e, Call):
        return tuple(a for arg in e.args for a in reads(arg))
    if isinstance(e, Cast):
        return reads(e.arg)
    return ()


def body_vars(e: Expr) -> frozenset[str]:
    found = frozenset().union(*(a.vars for a in reads(e)))
    return found | frozenset().union(*(free_vars(i.index) for i in index_values(e)))


def index_values(e: Expr) -> tuple[IndexValue, ...]:
    if isinstance(e, IndexValue):
        return (e,)
    if isinstance(e, Call):
        return tuple(v for arg in e.args for v in index_values(arg))
    if isinstance(e, Cast):
        return index_values(e.arg)
    return ()


def count_ops(e: Expr) -> int:
    """Scalar operations one evaluation of the body performs (its FLOPs per point)."""
    if isinstance(e, Call):
        return 1 + sum(count_ops(a) for a in e.args)
    if isinstance(e, Cast):
        return count_ops(e.arg)
    return 0


def map_reads(e: Expr, fn: Callable[[Access], Expr]) -> Expr:
    """Rebuild the body with every read replaced by fn(access)."""
    if isinstance(e, Read):
        return fn(e.access)
    if isinstance(e, Call):
        return Call(e.op, tuple(map_reads(a, fn) for a in e.args))
    if isinstance(e, Cast):
        return Cast(e.dtype, map_reads(e.arg, fn))
    return e


def call(op: str, *args: Expr) -> Expr:
    return Call(op, tuple(args))


def substitute_expr(e, mapping: dict, ranges):
    """e with the index expressions in `mapping` put in for their variables (every access)."""
    if isinstance(e, Read):
        a = e.access
        return Read(Access(a.tensor, tuple(substitute(i, mapping, ranges) for i in a.indices)))
    if isinstance(e, IndexValue):
        return IndexValue(substitute(e.index, mapping, ranges))
    if isinstance(e, Call):
        return Call(e.op, tuple(substitute_expr(x, mapping, ranges) for x in e.args))
    if isinstance(e, Cast):
        return Cast(e.dtype, substitute_expr(e.arg, mapping, ranges))
    return e
