"""Reference interpreter: one loop over the graph, each equation evaluated with torch.

It defines what the IR means. Contractions of plain accesses go through einsum (or a sparse
matrix product when one operand is a sparse matrix), everything else through broadcasting:
each access becomes a tensor laid out over the node's loop variables, the body is evaluated
elementwise, and the reduction variables are reduced away. Large iteration spaces are chunked
along the first output variable so that memory stays bounded.
"""

from __future__ import annotations

import math
from typing import Mapping, MutableMapping

import torch

from .errors import StitchflowError
from .expr import Access, Call, Cast, Const, Expr, IndexValue, OPS, Read
from .graph import Graph, Node
from .index import evaluate
from .types import TensorType

CHUNK_ELEMENTS = 1 << 25  # bound on one chunk's iteration space


def run_graph(graph: Graph, env: MutableMapping[str, torch.Tensor], nodes=None) -> MutableMapping[str, torch.Tensor]:
    """Evaluate `nodes` (default: all) in order, adding their outputs to `env`."""
    for node in nodes if nodes is not None else graph.nodes:
        env[node.name] = eval_node(node, env, graph.type_of[node.name])
    return env


def eval_node(node: Node, env: Mapping[str, torch.Tensor], out_type: TensorType) -> torch.Tensor:
    result = _try_contraction(node, env, out_type)
    if result is None:
        result = _eval_broadcast(node, env, out_type)
    if isinstance(node.body, Read) and _shares_storage(result, env.get(node.body.access.tensor)):
        result = result.clone()  # a plain read can come back as its operand (a view): a node's value is its own
    return result


def _shares_storage(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.layout == b.layout == torch.strided
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


# ---------------------------------------------------------------- contractions

def _product_factors(e: Expr) -> list[Expr] | None:
    if isinstance(e, Call) and e.op == "mul":
        left, right = _product_factors(e.args[0]), _product_factors(e.args[1])
        return None if left is None or right is None else left + right
    if isinstance(e, (Read, Const)):
        return [e]
    return None


def _try_contraction(node: Node, env, out_type: TensorType) -> torch.Tensor | None:
    if node.reduce != "sum" or node.is_scatter or not node.reduce_vars:
        return None
    factors = _product_factors(node.body)
    if factors is None:
        return None
    accesses = [f.access for f in factors if isinstance(f, Read)]
    if len(accesses) < 2:
        return None
    if not set(node.out_vars) <= set().union(*(a.vars for a in accesses)):
        return None  # an output dim no operand indexes (size 1): einsum cannot name it
    scalar = 1.0
    for f in factors:
        if isinstance(f, Const):
            scalar *= f.value
    if not all(a.is_plain for a in accesses):
        return _finish(_gathered_einsum(node, accesses, env, out_type) * scalar, out_type)
    operands = [_within_loop(env[a.tensor], a, node) for a in accesses]
    sparse = [i for i, t in enumerate(operands) if t.layout != torch.strided]
    if len(accesses) == 2 and len(sparse) == 1:
        out = _sparse_matmul(accesses, operands, sparse[0], node)
        if out is not None:
            return _finish(out * scalar if scalar != 1.0 else out, out_type)
    letters = _letters(node)
    spec = ",".join("".join(letters[i.name] for i in a.indices) for a in accesses)
    spec += "->" + "".join(letters[v] for v in node.out_vars)
    dense = [t.to_dense() if t.layout != torch.strided else t for t in operands]
    dtype = torch.promote_types(out_type.dtype, torch.float32) if out_type.dtype.is_floating_point else out_type.dtype
    out = torch.einsum(spec, *(t.to(dtype) for t in dense))
    return _finish(out * scalar if scalar != 1.0 else out, out_type)


def _within_loop(t: torch.Tensor, a, node: Node) -> torch.Tensor:
    """The part of an operand the loop reads: x[:, :4] @ w reads x[i, k] with k over 4 of x's 7 columns."""
    extents = [node.extents[i.name] for i in a.indices]
    if list(t.shape) == extents or t.layout != torch.strided:
        return t
    return t[tuple(slice(0, n) for n in extents)]


def _gathered_einsum(node: Node, accesses, env, out_type: TensorType) -> torch.Tensor:
    """A contraction whose operands are read through index arithmetic (head splits, gathers):
    gather each operand over just its own variables, then one einsum. Never the whole
    iteration space at once, which is what makes attention fit in memory."""
    letters = _letters(node)
    dense_env = _DenseView(env)
    device = _device_of(node, env)
    operands, specs = [], []
    for a in accesses:
        names = [v for v, _ in node.dims if v in a.vars]
        ranges = {v: (0, node.extents[v]) for v in names}
        grid = _grid(names, ranges, device)
        t = _load(a, names, grid, ranges, dense_env)
        operands.append(t.expand([node.extents[v] for v in names]) if names else t)
        specs.append("".join(letters[v] for v in names))
    dtype = torch.promote_types(out_type.dtype, torch.float32) if out_type.dtype.is_floating_point else out_type.dtype
    spec = ",".join(specs) + "->" + "".join(letters[v] for v in node.out_vars)
    return torch.einsum(spec, *(t.to(dtype) for t in operands))


def _device_of(node: Node, env) -> torch.device:
    """Where the node's inputs are; a node that reads none (an arange) is made where the program's tensors are."""
    for name in node.inputs:
        t = env.get(name) if hasattr(env, "get") else None
        if isinstance(t, torch.Tensor):
            return t.device
    values = env.values() if not node.inputs and hasattr(env, "values") else ()
    return next((t.device for t in values if isinstance(t, torch.Tensor)), torch.device("cpu"))


def _grid(loop, ranges, device) -> dict:
    """One int64 arange per loop variable, shaped to broadcast over the loop's axes."""
    grid = {}
    for axis, v in enumerate(loop):
        shape = [1] * len(loop)
        shape[axis] = ranges[v][1] - ranges[v][0]
        grid[v] = torch.arange(*ranges[v], dtype=torch.int64, device=device).view(shape)
    return grid


def _sparse_matmul(accesses, operands, which: int, node: Node) -> torch.Tensor | None:
    """out[i,j] = sum_k S[i,k] * D[k,j] (in any operand order) as torch.sparse.mm."""
    s_acc, d_acc = accesses[which], accesses[1 - which]
    if len(s_acc.indices) != 2 or len(d_acc.indices) != 2 or len(node.reduce_vars) != 1:
        return None
    k = node.reduce_vars[0]
    s_idx = [i.name for i in s_acc.indices]
    d_idx = [i.name for i in d_acc.indices]
    if k not in s_idx or k not in d_idx:
        return None
    s, d = operands[which], operands[1 - which]
    i = s_idx[1 - s_idx.index(k)]
    j = d_idx[1 - d_idx.index(k)]
    if s_idx.index(k) == 0:
        s = s.t()
    if d_idx.index(k) == 1:
        d = d.t()
    if s.layout not in (torch.sparse_csr, torch.sparse_coo):  # CSC, BSR, BSC: convert for the kernel
        s = s.to_dense().to_sparse_csr()
    out = torch.sparse.mm(s, d.to(s.dtype).contiguous()).to_dense() if s.layout == torch.sparse_coo else s @ d.to(s.dtype)
    if out.layout != torch.strided:
        out = out.to_dense()
    return out if node.out_vars == (i, j) else out.t()


def _letters(node: Node) -> dict[str, str]:
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return {v: alphabet[n] for n, (v, _) in enumerate(node.dims)}


def _finish(out: torch.Tensor, out_type: TensorType) -> torch.Tensor:
    return out.to(out_type.dtype).contiguous()


# ---------------------------------------------------------------- general broadcasting path

def _eval_broadcast(node: Node, env, out_type: TensorType) -> torch.Tensor:
    loop = list(node.out_vars) + list(node.reduce_vars)
    if node.is_scatter:
        loop = [v for v, _ in node.dims]
    extents = node.extents
    total = 1
    for v in loop:
        total *= extents[v]
    first = loop[0] if loop else None
    if node.is_scatter or first is None or total <= CHUNK_ELEMENTS or first not in node.out_vars:
        return _eval_range(node, env, out_type, loop, {})
    step = max(1, CHUNK_ELEMENTS * extents[first] // total)
    parts = [
        _eval_range(node, env, out_type, loop, {first: (lo, min(lo + step, extents[first]))})
        for lo in range(0, extents[first], step)
    ]
    return torch.cat(parts, dim=node.out_vars.index(first))


def _eval_range(node: Node, env, out_type: TensorType, loop: list[str], limits: dict) -> torch.Tensor:
    """Evaluate the node over `loop` variables, restricted to `limits[var] = (lo, hi)`."""
    rank = len(loop)
    ranges = {v: limits.get(v, (0, node.extents[v])) for v in loop}
    grid = _grid(loop, ranges, _device_of(node, env))
    dense_env = _DenseView(env)
    value = _eval_expr(node.body, loop, grid, ranges, dense_env)
    if not isinstance(value, torch.Tensor):  # a fill kernel: torch.tensor would copy from the host and wait for the device
        value = torch.full((), value, device=_device_of(node, env))
    full = [ranges[v][1] - ranges[v][0] for v in loop]
    value = value.expand(full) if value.dim() == rank else value.reshape([1] * rank).expand(full)
    if node.is_scatter:
        return _scatter(node, value, grid, dense_env, out_type)
    n_out = len(node.out_vars)
    red_axes = tuple(range(n_out, rank))
    if red_axes:
        acc = torch.promote_types(value.dtype, torch.float32) if value.dtype.is_floating_point else value.dtype
        if node.reduce == "sum":
            value = value.to(acc).sum(dim=red_axes)
        elif node.reduce == "max":
            value = value.amax(dim=red_axes)
        elif node.reduce == "prod":
            value = value.to(acc)
            for axis in reversed(red_axes):  # torch.prod takes one dim at a time
                value = value.prod(dim=axis)
        else:
            raise StitchflowError(f"node {node.name} has loop variables {node.reduce_vars} but no reduction")
    return value.to(out_type.dtype).contiguous()


SCATTER_REDUCE = {"max": "amax", "min": "amin", "prod": "prod"}  # torch's names for the scatter's reductions


def scatter_identity(reduce: str, dtype: torch.dtype):
    """What a scatter's output holds where nothing was written."""
    if reduce in ("sum", "prod"):
        return int(reduce == "prod")
    if dtype.is_floating_point:
        return -math.inf if reduce == "max" else math.inf
    info = torch.iinfo(dtype)
    return info.min if reduce == "max" else info.max


def _scatter(node: Node, value, grid, env, out_type: TensorType) -> torch.Tensor:
    # (an index without a gathered tensor, a literal among them, evaluates on the CPU)
    idx = tuple(evaluate(i, grid, env).to(value.device).expand(value.shape) for i in node.index)
    widen = node.reduce in ("sum", "prod") and out_type.dtype.is_floating_point
    acc = torch.promote_types(out_type.dtype, torch.float32) if widen else out_type.dtype
    if node.reduce != "sum":
        out = torch.full(out_type.shape, scatter_identity(node.reduce, acc), dtype=acc, device=value.device)
        out.view(-1).scatter_reduce_(0, _flat_index(idx, out).reshape(-1), value.to(acc).reshape(-1),
                                     SCATTER_REDUCE[node.reduce])
        return out.to(out_type.dtype)
    out = torch.zeros(out_type.shape, dtype=acc, device=value.device)
    if torch.are_deterministic_algorithms_enabled() or not out.numel():
        out.index_put_(idx, value.to(acc), accumulate=True)
        return out.to(out_type.dtype)
    # One flat index and index_add_: on CUDA, index_put_'s accumulation sorts the indices first
    # (about 8x the time of the atomic adds index_add_ does).
    out.view(-1).index_add_(0, _flat_index(idx, out).reshape(-1), value.to(acc).reshape(-1))
    return out.to(out_type.dtype)


def _flat_index(idx, out: torch.Tensor) -> torch.Tensor:
    flat = torch.zeros((), dtype=torch.int64, device=out.device)
    for i, stride in zip(idx, out.stride()):
        flat = flat + i * stride
    return flat


class _DenseView(dict):
    """The environment with sparse tensors densified on first use (reference semantics)."""

    def __init__(self, env):
        super().__init__()
        self._env = env

    def __missing__(self, key):
        t = self._env[key]
        t = t.to_dense() if t.layout != torch.strided else t
        self[key] = t
        return t


def _eval_expr(e: Expr, loop, grid, ranges, env):
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Read):
        return _load(e.access, loop, grid, ranges, env)
    if isinstance(e, IndexValue):
        return evaluate(e.index, grid, env)
    if isinstance(e, Cast):
        v = _eval_expr(e.arg, loop, grid, ranges, env)
        return v.to(e.dtype) if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=e.dtype)
    args = [_eval_expr(a, loop, grid, ranges, env) for a in e.args]
    return OPS[e.op].fn(*args)


def _load(access: Access, loop, grid, ranges, env) -> torch.Tensor:
    t = env[access.tensor]
    in_bounds = all(ranges[i.name][1] <= n for i, n in zip(access.indices, t.shape)) if access.is_plain else False
    if in_bounds and len(access.indices) == t.dim():
        names = [i.name for i in access.indices]
        for d, v in enumerate(names):
            lo, hi = ranges[v]
            if (lo, hi) != (0, t.shape[d]):
                t = t.narrow(d, lo, hi - lo)
        order = sorted(range(len(names)), key=lambda d: loop.index(names[d]))
        t = t.permute(order)
        shape = [1] * len(loop)
        for d in order:
            shape[loop.index(names[d])] = t.shape[order.index(d)]
        return t.reshape(shape) if t.dim() else t
    # Reads outside the tensor are clamped: the IR allows them only under a `where` that
    # discards them (concatenation), as a masked load would.
    idx = tuple(evaluate(i, grid, env).clamp(0, size - 1) for i, size in zip(access.indices, t.shape))
    return t[idx] if idx else t
