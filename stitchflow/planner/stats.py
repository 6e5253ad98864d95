"""Densities for the static cost models: measured from tensors when given, else assumed.

A tensor's *storage* density is what a scan of it visits: 1.0 for a dense format (a dense level
yields every coordinate, zeros included), nnz/numel for a compressed one, and with sparsity
blocking of b the fraction of non-empty b x b tiles (each tile is one token of b^2 values).
A node's *value* density (its output stream inside a fused region) follows from its body:
products intersect (multiply densities), sums unite, zero-preserving unary ops keep the
density, other ops (exp, comparisons, ...) produce dense values.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

from ..ir.expr import Call, Cast, Const, Read
from ..ir.graph import Graph, Node

ASSUMED_DENSITY = 0.1  # a sparse input we have no values for (FuseFlow's weights are 50-90% sparse)
MEASURE_LIMIT = 1 << 26  # above this many entries a dense-stored tensor's tiles are estimated
ZERO_PRESERVING = frozenset({"neg", "abs", "relu", "sqrt", "tanh", "erf", "sin", "floor", "ceil", "round", "log1p",
                             "expm1", "trunc"})
UNION = frozenset({"add", "sub", "max", "min", "or", "where", "bitor", "bitxor"})
ZERO_DIVIDEND = frozenset({"div", "floordiv", "truncdiv", "mod", "fmod", "shl", "shr"})  # 0 op y is 0


@dataclass(frozen=True)
class Densities:
    """Storage densities of graph inputs and parameters; `blocks` holds (name, b) -> tile density."""

    values: tuple[tuple[str, float], ...] = ()
    blocks: tuple[tuple[tuple[str, int], float], ...] = ()
    assumed: float = ASSUMED_DENSITY
    measured: bool = field(default=False, compare=True)

    def __str__(self) -> str:
        shown = ", ".join(f"{n}={d:.3g}" for n, d in self.values if d < 1.0)
        return f"densities({'measured' if self.measured else 'assumed'}: {shown or 'all dense'})"

    @functools.cached_property
    def _values(self) -> dict:
        return dict(self.values)

    @functools.cached_property
    def _blocks(self) -> dict:
        return dict(self.blocks)

    def storage(self, graph: Graph, name: str, block: int | None = None) -> float:
        """Density a scan of `name` (an input, parameter or stored intermediate) visits."""
        fmt = graph.type_of[name].format
        if fmt.is_dense:
            return 1.0
        d = self._values.get(name, self.assumed)
        if not block or len(graph.type_of[name].shape) != 2:
            return d
        known = self._blocks.get((name, block))
        return known if known is not None else tile_density(d, block)


def tile_density(d: float, b: int) -> float:
    """Fraction of b x b tiles holding a non-zero, if non-zeros are independent."""
    return 1.0 - (1.0 - min(max(d, 0.0), 1.0)) ** (b * b)


def _nnz(t: torch.Tensor) -> int:
    if t.layout == torch.strided:
        return int(torch.count_nonzero(t))
    if t.layout in (torch.sparse_bsr, torch.sparse_bsc):
        return int(torch.count_nonzero(t.values()))
    return int(t._nnz()) if t.layout == torch.sparse_coo else int(t.values().numel())


def _tile_occupancy(t: torch.Tensor, b: int) -> float | None:
    rows, cols = t.shape
    tiles = math.ceil(rows / b) * math.ceil(cols / b)
    if t.layout == torch.strided:
        if t.numel() > MEASURE_LIMIT:
            return None
        pad = torch.zeros(math.ceil(rows / b) * b, math.ceil(cols / b) * b, dtype=torch.bool)
        pad[:rows, :cols] = t != 0
        occupied = pad.view(pad.shape[0] // b, b, pad.shape[1] // b, b).any(dim=3).any(dim=1)
        return float(occupied.sum()) / tiles
    if t.layout in (torch.sparse_bsr, torch.sparse_bsc):
        t = t.to_dense()
        return _tile_occupancy(t, b) if t.numel() <= MEASURE_LIMIT else None
    idx = t.to_sparse_coo().coalesce().indices()
    keys = (idx[0] // b) * math.ceil(cols / b) + idx[1] // b
    return float(torch.unique(keys).numel()) / tiles


def measure(graph: Graph, values: Mapping[str, torch.Tensor] | None, blocks=(),
            assumed: float = ASSUMED_DENSITY) -> Densities:
    """Densities of every sparse-format input and parameter found in `values` (name -> tensor);
    the others get `assumed`. `blocks` lists the tile sizes to measure tile occupancy for."""
    values = values or {}
    dens, tiles = [], []
    for name in (*graph.inputs, *graph.params):
        t = values.get(name)
        if graph.type_of[name].format.is_dense or not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        dens.append((name, _nnz(t) / t.numel()))
        for b in blocks:
            if t.dim() == 2 and b:
                occ = _tile_occupancy(t, int(b))
                if occ is not None:
                    tiles.append(((name, int(b)), occ))
    return Densities(tuple(dens), tuple(tiles), assumed, measured=bool(values))


def body_density(body, density) -> float:
    """Value density of an elementwise body given each read's density (see module docstring)."""
    if isinstance(body, Read):
        return density(body.access.tensor)
    if isinstance(body, Const):
        return 0.0 if body.value == 0 else 1.0
    if isinstance(body, Cast):
        return body_density(body.arg, density)
    if not isinstance(body, Call):
        return 1.0
    args = [body_density(a, density) for a in body.args]
    if body.op in ("mul", "and", "bitand"):
        return math.prod(args)
    if body.op in ZERO_DIVIDEND:
        return args[0]
    if body.op in UNION:
        kept = args[1:] if body.op == "where" else args
        return 1.0 - math.prod(1.0 - a for a in kept)
    if body.op in ZERO_PRESERVING or body.op == "pow":
        return args[0]
    return 1.0


def iteration_density(node: Node, density) -> float:
    """Fraction of the node's iteration space (all its variables) that the dataflow visits."""
    return min(1.0, body_density(node.body, density))


def output_density(node: Node, density) -> float:
    """Density of the node's result: a reduction is non-zero where any reduced point is."""
    rho = iteration_density(node, density)
    reduced = math.prod(node.extents[v] for v in node.reduce_vars) if node.reduce_vars else 1
    return 1.0 - (1.0 - rho) ** reduced if reduced > 1 else rho


def stream_densities(graph: Graph, dens: Densities, block: int | None = None) -> dict[str, float]:
    """Value density of every node's result (as a stream inside a region), in graph order."""
    out: dict[str, float] = {}

    def density(name: str) -> float:
        return out[name] if name in out else dens.storage(graph, name, block)

    for node in graph.nodes:
        out[node.name] = output_density(node, density)
    return out
