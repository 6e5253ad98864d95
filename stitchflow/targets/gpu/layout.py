"""Where a kernel that takes an output with any strides (the attention kernel) should write it.

A node `y[v...] = x[f(v...)]` whose indices f are digits of y's variables (v, v // c, v % m,
(v // c) % m, a 0 where x has extent 1) is a bijection when the digits of every variable tile it
exactly: then x is a strided view of a contiguous y, and the producer of x can write y directly,
so that the copy never runs. Merging attention heads, `o.transpose(1, 2).reshape(B, S, H * D)`, is
such a node: `out[i, j, l] = o[0, l // 64, j, l % 64]`, and o is out seen with strides
(S·H·D, 64, H·D, 1). When the single reader is not a copy but reads x the same way (GPT-3's
output projection, `sum_k o[k // 64, i, k % 64] · W[j, k]`), x is laid out as that reader walks
it, so that the reader sees a contiguous [i, k] operand instead of copying a permuted one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ...ir.expr import Access, Read, map_reads
from ...ir.graph import Graph, Node
from ...ir.index import Div, Mod, Var
from ...ir.types import dense_type


def _digit(index) -> tuple[str, int, bool] | None:
    """(variable, weight of the digit's lowest place, bounded) of v, v // c, v % m, (v // c) % m;
    `bounded` when a modulus caps the digit (else it must be the variable's top digit)."""
    if isinstance(index, Var):
        return index.name, 1, False
    if isinstance(index, Div) and isinstance(index.arg, Var):
        return index.arg.name, index.divisor, False
    if isinstance(index, Mod):
        inner = _digit(index.arg)
        if inner is not None and not inner[2]:
            return inner[0], inner[1], True
    return None


def copy_strides(node: Node, x_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The strides of x inside a contiguous y when `node` (y = a reordering of x) moves every element of x
    once, else None."""
    if node.reduce or node.is_scatter or not isinstance(node.body, Read):
        return None
    access = node.body.access
    extents = node.extents
    y_vars = node.out_vars
    if len(access.indices) != len(x_shape) or math.prod(extents[v] for v in y_vars) != math.prod(x_shape):
        return None
    y_stride = {v: math.prod(extents[w] for w in y_vars[k + 1:]) for k, v in enumerate(y_vars)}
    places: dict[str, list[tuple[int, int, int, bool]]] = {}  # var -> (weight, size, x dim, bounded)
    for dim, (index, size) in enumerate(zip(access.indices, x_shape)):
        if size == 1:  # an index into an extent of 1 (in range, as every read is) is 0, whatever its form
            continue
        digit = _digit(index)
        if digit is None or digit[0] not in y_stride:
            return None
        places.setdefault(digit[0], []).append((digit[1], size, dim, digit[2]))
    strides = [0] * len(x_shape)
    for v, extent in extents.items():
        digits = sorted(places.get(v, ()))
        weight = 1
        for k, (low, size, dim, bounded) in enumerate(digits):  # lowest place first, tiling v exactly
            if low != weight or (not bounded and k != len(digits) - 1):
                return None
            strides[dim] = low * y_stride[v]
            weight = low * size
        if weight != extent and extent > 1:
            return None
    return tuple(strides)


@dataclass(frozen=True)
class Store:
    """x written as a view of a contiguous buffer of `shape`: the copy node `into` (which then never runs),
    or a buffer of x's own (into None) laid out as x's reader walks it."""

    into: str | None
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    reader: str | None = None    # (into None) the node that reads x, and its loop variables over x in order
    walk: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = f"into {self.into}" if self.into else f"as its reader walks it, {list(self.shape)}"
        return f"written {where} (strides {self.strides})"

    def buffer_name(self, output: str) -> str:
        return self.into or f"{output}_walked"


def output_store(graph: Graph, output: str, inside: set) -> Store | None:
    """How `output` is best stored for its only reader (a node in `inside`; `output` not a result of the
    program): into that reader when it is a copy that reorders it (copy_strides) in the same dtype, else
    laid out as the reader's access walks it when that access is such a reordering and not already the
    plain row-major one. None: store it contiguous."""
    readers = graph.consumers.get(output, ())
    if len(readers) != 1 or readers[0] not in inside or output in graph.outputs:
        return None
    node = graph.node_of[readers[0]]
    x_type, y_type = graph.type_of[output], graph.type_of[node.name]
    x_shape = tuple(x_type.shape)
    if x_type.dtype == y_type.dtype and y_type.format.is_dense:
        strides = copy_strides(node, x_shape)
        if strides is not None:
            return Store(node.name, tuple(y_type.shape), strides)
    accesses = {a for a in node.accesses if a.tensor == output}
    if len(accesses) != 1:
        return None
    (access,) = accesses
    order = [v for v, _ in node.dims if v in access.vars]  # the reader's loop order over x
    walk = Node("__walk", tuple(Var(v) for v in order), Read(access), tuple((v, node.extents[v]) for v in order))
    strides = copy_strides(walk, x_shape)
    if strides is None or strides == _row_major(x_shape):
        return None
    return Store(None, tuple(node.extents[v] for v in order), strides, node.name, tuple(order))


def read_walked(graph: Graph, stores: dict[str, Store]) -> Graph:
    """The graph with each reader of a walked output (Store.into None) reading the contiguous buffer at its
    plain loop variables, `{x}_walked[i, k]`, instead of x through digits: to the GEMM matcher and the
    stitched kernels an output projection is then a plain GEMM (its bias and residual fused after it)."""
    walked = {x: st for x, st in stores.items() if st.into is None}
    if not walked:
        return graph
    by_reader = {st.reader: (x, st) for x, st in walked.items()}
    nodes = []
    for node in graph.nodes:
        if node.name in by_reader:
            x, st = by_reader[node.name]
            plain = Read(Access(st.buffer_name(x), tuple(Var(v) for v in st.walk)))
            body = map_reads(node.body, lambda a, x=x, plain=plain: plain if a.tensor == x else Read(a))
            node = replace(node, body=body)
        nodes.append(node)
    types = tuple((st.buffer_name(x), dense_type(st.shape, graph.type_of[x].dtype)) for x, st in walked.items())
    return replace(graph, nodes=tuple(nodes), types=graph.types + types)


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[k + 1:]) if shape[k] > 1 else 0 for k in range(len(shape)))
