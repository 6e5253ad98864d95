"""Index expressions: how an access maps loop variables to a tensor's coordinates.

Views (transpose, permute, reshape, head splitting, slicing, broadcasting) become index
arithmetic on an access instead of copies, as linalg's indexing maps do. Expressions are kept
in a simplified normal form: an affine sum of atoms (variables, floor-divisions, remainders and
gathers), simplified with the known extents of the variables so that `(64*h + d) // 64` is `h`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

import torch


@dataclass(frozen=True)
class Var:
    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Lit:
    value: int

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class Sum:
    """sum(coef * atom) + const, with at least two terms or a constant; terms sorted by str."""

    terms: tuple[tuple[int, "IndexExpr"], ...]
    const: int = 0

    def __str__(self) -> str:
        parts = [str(a) if c == 1 else f"{c}*{a}" for c, a in self.terms]
        if self.const:
            parts.append(str(self.const))
        return " + ".join(parts).replace("+ -", "- ")


@dataclass(frozen=True)
class Div:
    arg: "IndexExpr"
    divisor: int

    def __str__(self) -> str:
        return f"({self.arg} // {self.divisor})"


@dataclass(frozen=True)
class Mod:
    arg: "IndexExpr"
    modulus: int

    def __str__(self) -> str:
        return f"({self.arg} % {self.modulus})"


@dataclass(frozen=True)
class Gather:
    """The integer stored at tensor[indices]: an indirect access (x[idx[e], f])."""

    tensor: str
    indices: tuple["IndexExpr", ...]

    def __str__(self) -> str:
        return f"{self.tensor}[{', '.join(map(str, self.indices))}]"


IndexExpr = Union[Var, Lit, Sum, Div, Mod, Gather]
Ranges = Mapping[str, int]  # variable name -> extent (values 0 .. extent-1)

UNBOUNDED = 1 << 62


def fresh_name(name: str, taken: set) -> str:
    """`name`, with underscores added until it is not in `taken`; added to `taken`."""
    while name in taken:
        name += "_"
    taken.add(name)
    return name


def as_index(e: "IndexExpr | int | str") -> IndexExpr:
    if isinstance(e, int):
        return Lit(e)
    if isinstance(e, str):
        return Var(e)
    return e


# ---------------------------------------------------------------- linear normal form

def affine_terms(e: IndexExpr) -> tuple[dict, int]:
    """e as ({atom: coefficient}, constant), a new dict: atoms are variables, divisions, remainders, gathers."""
    if isinstance(e, Lit):
        return {}, e.value
    if isinstance(e, Sum):
        return {a: c for c, a in e.terms}, e.const
    return {e: 1}, 0


def _from_linear(terms: dict, const: int) -> IndexExpr:
    terms = {a: c for a, c in terms.items() if c != 0}
    if not terms:
        return Lit(const)
    if len(terms) == 1 and const == 0:
        ((a, c),) = terms.items()
        if c == 1:
            return a
    ordered = tuple(sorted(((c, a) for a, c in terms.items()), key=lambda ca: str(ca[1])))
    return Sum(ordered, const)


def add(*es: IndexExpr | int) -> IndexExpr:
    terms: dict = {}
    const = 0
    for e in es:
        t, c = affine_terms(as_index(e))
        const += c
        for a, k in t.items():
            terms[a] = terms.get(a, 0) + k
    return _from_linear(terms, const)


def scale(e: IndexExpr | int, k: int) -> IndexExpr:
    t, c = affine_terms(as_index(e))
    return _from_linear({a: v * k for a, v in t.items()}, c * k)


def bounds(e: IndexExpr, ranges: Ranges) -> tuple[int, int]:
    """Inclusive lower and upper bound of e given variable extents."""
    if isinstance(e, Var):
        n = ranges.get(e.name)
        return (0, n - 1) if n is not None else (0, UNBOUNDED)
    if isinstance(e, Lit):
        return e.value, e.value
    if isinstance(e, Sum):
        lo = hi = e.const
        for c, a in e.terms:
            alo, ahi = bounds(a, ranges)
            lo, hi = (lo + c * alo, hi + c * ahi) if c >= 0 else (lo + c * ahi, hi + c * alo)
        return lo, hi
    if isinstance(e, Div):
        lo, hi = bounds(e.arg, ranges)
        return lo // e.divisor, hi // e.divisor
    if isinstance(e, Mod):
        lo, hi = bounds(e.arg, ranges)
        if lo >= 0 and hi < e.modulus:
            return lo, hi
        return 0, e.modulus - 1
    return 0, UNBOUNDED  # a gathered index: non-negative, size unknown here


def _split(e: IndexExpr, d: int) -> tuple[IndexExpr, IndexExpr]:
    """e = d*q + r where q collects the terms divisible by d."""
    t, c = affine_terms(e)
    q = {a: k // d for a, k in t.items() if k % d == 0}
    r = {a: k for a, k in t.items() if k % d != 0}
    return _from_linear(q, c // d), _from_linear(r, c % d)


def floordiv(e: IndexExpr | int, d: int, ranges: Ranges) -> IndexExpr:
    e = as_index(e)
    if d == 1:
        return e
    q, r = _split(e, d)
    lo, hi = bounds(r, ranges)
    if 0 <= lo and hi < d:
        return q
    lo, hi = bounds(e, ranges)
    if 0 <= lo and hi < d:
        return Lit(0)
    return Div(e, d)


def mod(e: IndexExpr | int, m: int, ranges: Ranges) -> IndexExpr:
    e = as_index(e)
    if m == 1:
        return Lit(0)
    _, r = _split(e, m)
    lo, hi = bounds(r, ranges)
    if 0 <= lo and hi < m:
        return r
    return Mod(e, m)


# ---------------------------------------------------------------- traversal

def free_vars(e: IndexExpr) -> frozenset[str]:
    if isinstance(e, Var):
        return frozenset((e.name,))
    if isinstance(e, Lit):
        return frozenset()
    if isinstance(e, Sum):
        return frozenset().union(*(free_vars(a) for _, a in e.terms))
    if isinstance(e, (Div, Mod)):
        return free_vars(e.arg)
    return frozenset().union(*(free_vars(i) for i in e.indices))


def gathered_tensors(e: IndexExpr) -> frozenset[str]:
    if isinstance(e, Gather):
        inner = frozenset().union(*(gathered_tensors(i) for i in e.indices))
        return inner | {e.tensor}
    if isinstance(e, Sum):
        return frozenset().union(*(gathered_tensors(a) for _, a in e.terms))
    if isinstance(e, (Div, Mod)):
        return gathered_tensors(e.arg)
    return frozenset()


def substitute(e: IndexExpr, mapping: Mapping[str, IndexExpr], ranges: Ranges) -> IndexExpr:
    """Replace variables by expressions and simplify with the extents of the new variables."""
    if isinstance(e, Var):
        return mapping.get(e.name, e)
    if isinstance(e, Lit):
        return e
    if isinstance(e, Sum):
        return add(*(scale(substitute(a, mapping, ranges), c) for c, a in e.terms), e.const)
    if isinstance(e, Div):
        return floordiv(substitute(e.arg, mapping, ranges), e.divisor, ranges)
    if isinstance(e, Mod):
        return mod(substitute(e.arg, mapping, ranges), e.modulus, ranges)
    return Gather(e.tensor, tuple(substitute(i, mapping, ranges) for i in e.indices))


def rename(e: IndexExpr, names: Mapping[str, str]) -> IndexExpr:
    return substitute(e, {k: Var(v) for k, v in names.items()}, {})


def evaluate(e: IndexExpr, env: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Evaluate to an int64 tensor; variables are int64 tensors that broadcast together."""
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Lit):
        return torch.tensor(e.value, dtype=torch.int64)
    if isinstance(e, Sum):
        out = torch.tensor(e.const, dtype=torch.int64)
        for c, a in e.terms:
            out = out + c * evaluate(a, env, tensors)
        return out
    if isinstance(e, Div):
        return torch.div(evaluate(e.arg, env, tensors), e.divisor, rounding_mode="floor")
    if isinstance(e, Mod):
        return torch.remainder(evaluate(e.arg, env, tensors), e.modulus)
    src = tensors[e.tensor]
    # clamped like the interpreter's reads: the IR reads outside a tensor only where a `where`
    # discards the value (a gather at a concatenation's or an upsampling's border)
    idx = [evaluate(i, env, tensors).clamp(0, n - 1) for i, n in zip(e.indices, src.shape)]
    return src[tuple(idx)].to(torch.int64) if idx else src.to(torch.int64)
