"""Queries laid out for torch's attention, so that its output needs no copy.

torch's cuDNN attention allocates its output with the stride order of Q (`alloc_with_matching_layout`), and a
language model's attention output is read with its heads merged, `o.transpose(1, 2).reshape(B, S, H * D)`:
[batch, length, heads, width] in memory (layout.output_store). A rotary embedding computes Q as a fresh
[batch, heads, length, width] tensor, so cuDNN's output came out heads-major and was copied into the merged
layout (12 µs a layer of a 2048-wide Llama at 4x512 tokens on an H200). Here the node that makes Q writes it in
the stride order of that store instead: `q[b, h, l, d]` becomes `q[b, l, h, d]` at the producer and at every
reader, which changes no value (the same permutation on both sides), and the attention step then finds the
library's output already laid out as the store wants (attention.py, `_library_runner`).

Only for attention that runs torch's (a mask of the call), and only where the whole life of Q is inside the
region: one elementwise producer there, every reader there, not an output of the program.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ...ir.expr import Access, Read, map_reads
from ...ir.graph import Graph
from ...ir.index import Var
from ...ir.types import dense_type

log = logging.getLogger("stitchflow.gpu")


def query_orders(graph: Graph, attentions, inside: set) -> dict[str, tuple[int, ...]]:
    """{Q's tensor: the order of its axes, outermost first} for each (AttentionMatch, layout.Store or None) of
    `attentions` that runs torch's attention (a mask of the call) into a store and whose Q may be laid out anew."""
    orders: dict[str, tuple[int, ...]] = {}
    for m, store in attentions:
        if m.call_mask is None or store is None:
            continue
        order = _store_order(graph, m, store.strides)
        if order is None or order == tuple(range(len(order))):
            continue
        why = why_fixed(graph, m.q.tensor, inside)
        if why:
            log.debug("%s: Q keeps its layout: %s", m.output, why)
        elif orders.setdefault(m.q.tensor, order) != order:
            del orders[m.q.tensor]  # two attentions want it laid out differently: leave it be
    return orders


def _store_order(graph: Graph, m, strides: tuple[int, ...]) -> tuple[int, ...] | None:
    """Q's axes sorted by the store's stride of the output axis each one becomes (the scores' batch axes in turn,
    the query axis, the feature axis becoming the output's width); None when Q's indices are not those variables."""
    scores = graph.node_of[m.scores]
    *batch, l_var, _ = scores.out_vars
    roles = {v: k for k, v in enumerate(batch)}
    roles[l_var] = len(batch)
    roles[scores.reduce_vars[0]] = len(batch) + 1
    if len(strides) != len(roles) or len(m.q.indices) != len(roles):
        return None
    if not all(isinstance(i, Var) and i.name in roles for i in m.q.indices):
        return None
    role = [roles[i.name] for i in m.q.indices]
    if sorted(role) != list(range(len(role))):
        return None
    return tuple(sorted(range(len(role)), key=lambda axis: -strides[role[axis]]))


def why_fixed(graph: Graph, x: str, inside: set) -> str | None:
    """Why `x` must keep its layout, or None when it may be laid out anew."""
    node = graph.node_of.get(x)
    if node is None or x in graph.outputs:
        return "an input or output of the program"
    if x not in inside or node.reduce is not None or node.is_scatter:
        return "not made by an elementwise node of this region"
    for reader in graph.consumers.get(x, ()):
        if reader not in inside:
            return f"read by {reader}, outside the region"
        for a in graph.node_of[reader].accesses:
            if x in a.tensors - {a.tensor}:
                return f"an index of {reader}"
    return None


def permute_values(graph: Graph, orders: dict[str, tuple[int, ...]]) -> Graph:
    """The graph with each value x of `orders` stored with its axes in that order: its producer's index and
    every read of it permuted alike, its type the permuted shape."""
    if not orders:
        return graph

    def permuted(a: Access):
        order = orders.get(a.tensor)
        return Read(a if order is None else Access(a.tensor, tuple(a.indices[k] for k in order)))

    nodes = []
    for node in graph.nodes:
        if node.name in orders:
            node = replace(node, index=tuple(node.index[k] for k in orders[node.name]))
        if any(t in orders for t in node.inputs):
            node = replace(node, body=map_reads(node.body, permuted))
        nodes.append(node)
    types = tuple((name, dense_type(tuple(ty.shape[k] for k in orders[name]), ty.dtype) if name in orders else ty)
                  for name, ty in graph.types)
    for name, order in orders.items():
        log.info("%s stored with its axes in the order %s, as torch's attention lays out its output", name, order)
    return replace(graph, nodes=tuple(nodes), types=types)
