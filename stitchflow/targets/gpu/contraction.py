"""Contractions run through torch: a GEMM-like node as one einsum or bmm over its operands where they lie
(strided views for permutes, head splits and broadcasts; one gather for other index arithmetic), in the operands'
dtype where they share the output's, as eager's matmul runs it."""

from __future__ import annotations

import dataclasses

import torch

from ...ir.expr import Access, Call, Cast, Const, Read
from ...ir.graph import Node
from ...ir.index import Div, Lit, Mod, Sum, Var, add, bounds, evaluate, substitute
from ...ir.index import scale as scale_index
from .analysis import factor_access, product_factors
from .batched_gemm import contiguous, plan_bmm, row_padded, run_bmm


def _gather_index(access, node: Node, names, env, device, shape) -> tuple:
    grid = {}
    for axis, v in enumerate(names):
        dims = [1] * len(names)
        dims[axis] = node.extents[v]
        grid[v] = torch.arange(node.extents[v], device=device).view(dims)
    idx = [evaluate(i, grid, env).to(device).clamp(0, n - 1) for i, n in zip(access.indices, shape)]
    full = torch.broadcast_shapes(*(i.shape for i in idx)) if idx else ()
    return tuple(i.expand(full) for i in idx)


def _affine_layout(access, node: Node, names, shape, stride) -> tuple | None:
    """(sizes, strides, offset) of the read as a strided view of a tensor of `shape` and `stride`
    over `names`, when every index is affine in the variables and stays in range: head splits
    (128*h + d), grouped-query heads (4*g + h) and broadcasts then cost no copy. None when some
    index is not affine (or is clamped), or runs backwards."""
    strides = dict.fromkeys(names, 0)
    offset = 0
    for idx, size, step in zip(access.indices, shape, stride):
        lo, hi = bounds(idx, node.extents)
        if lo < 0 or hi > size - 1:
            return None
        terms, const = ((((1, idx),), 0) if isinstance(idx, Var) else (idx.terms, idx.const) if isinstance(idx, Sum)
                        else ((), idx.value) if isinstance(idx, Lit) else (None, 0))
        if terms is None or any(not isinstance(a, Var) for _, a in terms):
            return None
        offset += const * step
        for c, a in terms:
            strides[a.name] += c * step
    if any(s < 0 for s in strides.values()):
        return None  # a flipped read (x.flip(1)): torch's strided views take no negative strides
    return [node.extents[v] for v in names], [strides[v] for v in names], offset


def _radix_digits(node: Node) -> Node:
    """A contraction whose variables are read through floor-divisions and remainders with them
    split into their mixed-radix digits, so that every read is affine again and runs as a strided
    view, not a gather: a reduced one (merge_heads: x[k // 128 // 4, k // 128 % 4, k % 128], k =
    512 a + 128 b + c) or an output one (ATen's mm over x.view(B * S, D): x[i // S, i % S, k]),
    whose digits then index the output in its place (`contract` merges them back by a reshape).
    The node itself when there is nothing to split."""
    points: dict = {}

    def chain(e):
        """(variable, divisor so far) for v, v // d, (v // d1) // d2; None otherwise."""
        if isinstance(e, Var):
            return e.name, 1
        if isinstance(e, Div):
            inner = chain(e.arg)
            if inner is not None:
                points.setdefault(inner[0], set()).add(inner[1] * e.divisor)
                return inner[0], inner[1] * e.divisor
        return None

    def visit(e):
        if isinstance(e, Mod):
            inner = chain(e.arg)
            if inner is not None:
                points.setdefault(inner[0], set()).add(inner[1] * e.modulus)
                return
            visit(e.arg)
        elif isinstance(e, Div):
            if chain(e) is None:
                visit(e.arg)
        elif isinstance(e, Sum):
            for _, a in e.terms:
                visit(a)

    factors = product_factors(node.body) or []
    accesses = [a for a in map(factor_access, factors) if a is not None]
    for a in accesses:
        for i in a.indices:
            visit(i)
    # output variables split only where every output index is a plain variable (digits replace it)
    splittable = set(node.reduce_vars) | (set(node.out_vars) if all(isinstance(i, Var) for i in node.index) else set())
    mapping, dims, out_digits = {}, [], {}
    for v, extent in node.dims:
        cuts = sorted(b for b in points.get(v, ()) if 1 < b < extent)
        if v not in splittable or not cuts or any(hi % lo for lo, hi in zip([1] + cuts, cuts + [extent])):
            dims.append((v, extent))
            continue
        bounds_ = [1] + cuts + [extent]
        digits = [(f"{v}_{k}", bounds_[k + 1] // bounds_[k], bounds_[k]) for k in range(len(cuts) + 1)]
        mapping[v] = add(*(scale_index(Var(name), weight) for name, _, weight in digits))
        dims += [(name, n) for name, n, _ in reversed(digits)]  # outer digit first
        out_digits[v] = tuple(Var(name) for name, _, _ in reversed(digits))
    if not mapping:
        return node
    index = tuple(d for i in node.index for d in (out_digits.get(i.name, (i,)) if isinstance(i, Var) else (i,)))
    ranges = dict(dims)

    def rewrite(e):
        if isinstance(e, Read):
            a = e.access
            return Read(Access(a.tensor, tuple(substitute(i, mapping, ranges) for i in a.indices)))
        if isinstance(e, Call):
            return Call(e.op, tuple(rewrite(x) for x in e.args))
        if isinstance(e, Cast):
            return Cast(e.dtype, rewrite(e.arg))
        return e

    split = dataclasses.replace(node, body=rewrite(node.body), dims=tuple(dims), index=index)
    for a in map(factor_access, product_factors(split.body) or []):
        if a is not None and any(isinstance(x, (Div, Mod)) for i in a.indices for x in _atoms(i)):
            return node  # some read stays non-affine: the gather path is as good
    return split


def _atoms(e):
    if isinstance(e, Sum):
        return [a for _, a in e.terms]
    return [e]


def dense_operand(access, node: Node, env, device, cache: dict) -> torch.Tensor:
    """A read as a dense tensor over its own variables (in first-use order): permutes, head
    splits and GQA broadcasts become strided views; other index arithmetic one gather, not a
    broadcast over the whole loop nest. Index tensors that do not depend on data are built
    once per device (cache)."""
    names = cache.get(("names", access))
    if names is None:
        names = cache[("names", access)] = sorted(access.vars, key=lambda v: [d for d, _ in node.dims].index(v))
    src = env[access.tensor]
    src = src.to_dense() if src.layout != torch.strided else src
    if access.is_plain and len(access.indices) == src.dim():
        src = src[tuple(slice(0, node.extents[i.name]) for i in access.indices)]  # x[:, :4] @ w: 4 of x's columns
        order = [[i.name for i in access.indices].index(v) for v in names]
        return src.permute(order), names
    if access.tensors == {access.tensor}:
        key = ("view", access, src.shape, src.stride())  # the layout is worked out once per source layout
        if key not in cache:
            cache[key] = _affine_layout(access, node, names, src.shape, src.stride())
        if cache[key] is not None:
            sizes, strides, offset = cache[key]
            return src.as_strided(sizes, strides, src.storage_offset() + offset), names
    key = (access, device)
    idx = cache.get(key)
    if idx is None:
        idx = _gather_index(access, node, names, env, device, src.shape)
        if access.tensors == {access.tensor}:
            cache[key] = idx
    out = src[idx]
    return out.expand([node.extents[v] for v in names]) if names else out, names


@dataclasses.dataclass(frozen=True)
class _Contraction:
    """What a contraction's einsum needs besides its operands, worked out on its first call."""

    node: Node  # with variables read through div/mod split into digits
    out_shape: tuple[int, ...]  # the original node's output (its digits merge back into it)
    spec: str
    scale: float
    kept: tuple[str, ...]  # output variables some operand reads (the others broadcast)


def _plan_contraction(node: Node, env, cache: dict) -> _Contraction:
    split = _radix_digits(node)
    letters = {v: "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"[k] for k, (v, _) in enumerate(split.dims)}
    scale, specs = 1.0, []
    for f in product_factors(split.body):
        if isinstance(f, Const):
            scale *= f.value
            continue
        access = factor_access(f)
        names = cache.get(("names", access)) or sorted(access.vars, key=lambda v: [d for d, _ in split.dims].index(v))
        specs.append("".join(letters[v] for v in names))
    used = set("".join(specs))
    for v in split.reduce_vars:  # summing over a variable no operand reads multiplies by its extent
        if letters[v] not in used:
            scale *= split.extents[v]
    kept = tuple(v for v in split.out_vars if letters[v] in used)
    return _Contraction(split, tuple(node.extents[v] for v in node.out_vars),
                        ",".join(specs) + "->" + "".join(letters[v] for v in kept), scale, kept)


def contract(node: Node, env, out_dtype: torch.dtype, cache: dict | None = None) -> torch.Tensor:
    """A GEMM-like node as one einsum, in the operands' dtype where they share the output's
    (cuBLAS accumulates half types in float32, as eager's matmul does). `cache` keeps index
    tensors, operand layouts and the plan (_Contraction): a training step's backward runs
    dozens of these, and their Python is on its critical path."""
    cache = {} if cache is None else cache
    plan = cache.get(("plan", node.name))
    if plan is None:
        plan = cache[("plan", node.name)] = _plan_contraction(node, env, cache)
    node = plan.node
    factors = [f for f in product_factors(node.body) if not isinstance(f, Const)]
    device = next(env[factor_access(f).tensor].device for f in factors if factor_access(f) is not None)
    operands = []
    for f in factors:
        t, _ = dense_operand(factor_access(f), node, env, device, cache)
        operands.append(t.to(f.dtype) if isinstance(f, Cast) else t)
    dtypes = {t.dtype for t in operands}
    compute = out_dtype if dtypes == {out_dtype} and out_dtype.is_floating_point else \
        torch.promote_types(out_dtype, torch.float32)
    out = _einsum(plan.spec, [t.to(compute) for t in operands], cache)
    out = out * plan.scale if plan.scale != 1.0 else out
    if len(plan.kept) != len(node.out_vars):  # broadcast output dims
        out = out.reshape([node.extents[v] if v in plan.kept else 1 for v in node.out_vars])
        out = out.expand([node.extents[v] for v in node.out_vars])
    out = out.to(out_dtype)
    return (out if row_padded(out) else contiguous(out)).reshape(plan.out_shape)


def _einsum(spec: str, operands: list[torch.Tensor], cache: dict) -> torch.Tensor:
    """torch.einsum, or one bmm over the operands where they lie (batched_gemm: einsum's reshapes
    copy operands that cuBLAS reads in place); the plan is kept per operand layout."""
    if len(operands) != 2 or not all(t.dtype.is_floating_point for t in operands):
        return torch.einsum(spec, *operands)
    key = ("bmm", spec) + tuple((t.shape, t.stride()) for t in operands)
    if key not in cache:
        cache[key] = plan_bmm(spec, tuple(tuple(t.shape) for t in operands), tuple(t.stride() for t in operands))
    plan = cache[key]
    return torch.einsum(spec, *operands) if plan is None else run_bmm(plan, *operands)
