"""Scalar (and tile) ALU operations: numpy versions of stitchflow.ir.expr.OPS, and the one fact
the lowering needs about each: what it gives on all-zero operands. An op with f(0, ..., 0) = 0
may iterate the union of its operands' coordinates; a product only their intersection; any
other op needs every coordinate (a dense iteration), as exp(0) = 1 is not zero."""

from __future__ import annotations

import numpy as np
from scipy import special

from ...ir import random

_NP = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": lambda a, b: _div(a, b),
    "pow": np.power, "max": np.maximum, "min": np.minimum,
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
    "eq": np.equal, "ne": np.not_equal,
    "and": lambda a, b: (np.asarray(a) != 0) & (np.asarray(b) != 0),
    "or": lambda a, b: (np.asarray(a) != 0) | (np.asarray(b) != 0),
    "not": lambda a: np.asarray(a) == 0,
    "neg": np.negative, "abs": np.abs, "exp": np.exp, "log": lambda a: _quiet(np.log, a),
    "sqrt": lambda a: _quiet(np.sqrt, a), "rsqrt": lambda a: _quiet(lambda x: 1.0 / np.sqrt(x), a),
    "recip": lambda a: _quiet(lambda x: 1.0 / x, a), "tanh": np.tanh,
    "sigmoid": special.expit, "erf": special.erf, "relu": lambda a: np.maximum(a, 0.0),
    "sin": np.sin, "cos": np.cos, "floor": np.floor, "ceil": np.ceil, "round": np.round,  # numpy's rounds half to even
    "log1p": lambda a: _quiet(np.log1p, a), "expm1": np.expm1,
    "trunc": np.trunc, "atan2": np.arctan2, "floordiv": lambda a, b: _quiet(np.floor_divide, a, b),
    "truncdiv": lambda a, b: _quiet(lambda x, y: np.trunc(np.divide(x, y)), a, b),
    "mod": lambda a, b: _quiet(np.remainder, a, b), "fmod": lambda a, b: _quiet(np.fmod, a, b),
    "bitand": lambda a, b: _ints(np.bitwise_and, a, b), "bitor": lambda a, b: _ints(np.bitwise_or, a, b),
    "bitxor": lambda a, b: _ints(np.bitwise_xor, a, b), "bitnot": lambda a: _ints(np.invert, a),
    "shl": lambda a, b: _ints(np.left_shift, a, b), "shr": lambda a, b: _ints(np.right_shift, a, b),
    "where": lambda c, a, b: np.where(np.asarray(c) != 0, a, b),
    "rand": lambda seed, offset: random.uniform(seed, offset).numpy(),
    "randn": lambda seed, offset: random.normal(seed, offset).numpy(),
}

SUPPORTED = frozenset(_NP) | {"cast"}
PRODUCTS = frozenset({"mul", "and", "bitand"})


def _quiet(fn, *args):
    with np.errstate(divide="ignore", invalid="ignore"):
        return fn(*args)


def _ints(fn, *args):
    """Bitwise ops on the streams' float64 values of integer tensors (exact below 2^53)."""
    return fn(*(np.asarray(a).astype(np.int64) for a in args))


def _div(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.divide(a, b)


def zero_preserving(op: str, consts: dict[int, float] | None = None, arity: int = 2) -> bool:
    """f(0, ..., 0) == 0, with the constant operands fixed at their values."""
    consts = consts or {}
    args = [np.float64(consts.get(k, 0.0)) for k in range(arity)]
    with np.errstate(all="ignore"):
        value = np.asarray(_NP[op](*args), dtype=np.float64)
    return bool(np.all(value == 0.0))


def apply_op(op: str, arrays: list, dtype: str | None, contract: tuple = (), axes_out: tuple = ()):
    """Evaluate op elementwise over item arrays (n, *tile) and constants. `contract` lists
    output tile axes summed away right after a product (a tile matrix multiply)."""
    if op == "cast":
        return _cast(arrays[0], dtype)
    if contract and op == "mul":
        return _contract(arrays, contract, axes_out)
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.asarray(_NP[op](*arrays), dtype=np.float64)
    if contract:
        out = out.sum(axis=tuple(1 + axes_out.index(a) for a in contract))
    return out


def _contract(arrays, contract, axes_out):
    """A product of tiles with some axes summed: one einsum (2b-1 latency on hardware)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    sub_of = {a: letters[1 + k] for k, a in enumerate(axes_out)}
    specs, operands = [], []
    for arr in arrays:
        if np.isscalar(arr) or np.ndim(arr) == 0:
            specs.append("")
            operands.append(np.asarray(arr, dtype=np.float64))
            continue
        spec = "a" + "".join(sub_of[ax] if arr.shape[1 + k] > 1 else "" for k, ax in enumerate(axes_out))
        squeezed = arr.reshape([arr.shape[0]] + [s for s in arr.shape[1:] if s > 1])
        specs.append(spec)
        operands.append(squeezed)
    out = "a" + "".join(sub_of[a] for a in axes_out if a not in contract)
    return np.einsum(",".join(specs) + "->" + out, *operands)


def _cast(a, dtype: str | None):
    if dtype == "bool":
        return (np.asarray(a) != 0).astype(np.float64)
    if dtype and ("int" in dtype or dtype == "long"):
        return np.trunc(a)
    return np.asarray(a, dtype=np.float64)
