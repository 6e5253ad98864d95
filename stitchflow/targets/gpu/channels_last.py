"""Channels-last storage for the activations around convolutions.

cuDNN runs half-precision convolutions on tensor cores in NHWC; given NCHW tensors it transposes
them first, or picks slower kernels. This pass stores every convolution's output, and the
intermediates connected to it axis for axis (batch norm, relu, the residual add, padding,
pooling windows), with the channel axes last. It is a graph rewrite that changes no value: a
node's output axes are permuted, and every read of it indexes the permuted axes, so the
generated kernels walk the channels innermost and `match_conv` finds the convolutions over
channels-last inputs. Graph outputs, inputs and parameters keep their order.

It rewrites the whole graph the same way whichever region is being compiled, so that the
regions agree on how an intermediate passed between them is stored.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from ...ir.expr import Access, Read, map_reads
from ...ir.graph import Graph, Node
from ...ir.index import free_vars
from ...ir.types import TensorType
from .conv import match_conv


def channels_last(graph: Graph) -> Graph:
    order = {name: perm for name, perm in _choose(graph).items() if perm != tuple(range(len(perm)))}
    if not order:
        return graph
    nodes = tuple(_permute_node(_reindex(n, order), order.get(n.name)) for n in graph.nodes)
    types = tuple((name, _permute_type(t, order[name]) if name in order else t) for name, t in graph.types)
    return dataclasses.replace(graph, nodes=nodes, types=types)


def _choose(graph: Graph) -> dict[str, tuple[int, ...]]:
    """node -> the permutation of its output axes (new axis k is old axis perm[k]): its channel axes
    moved last. A convolution's output and input are the seeds; the choice spreads to every node
    that reads or is read by a chosen one when each of its axes meets either only channel axes or
    only other axes of the read (a group norm's [N, G, C/G, H, W] reads the channel c as 4·g + i:
    both g and i are channel axes)."""
    keep = set(graph.outputs)
    channels: dict[str, frozenset[int]] = {}  # node -> its channel axes (in its own, original order)
    queue: deque = deque()

    def choose(name: str, axes) -> None:
        node = graph.node_of.get(name)
        if node is None or name in keep or name in channels or node.is_scatter or not axes:
            return
        if len(axes) == len(node.out_vars):
            return
        channels[name] = frozenset(axes)
        queue.append(name)

    for node in graph.nodes:
        call = match_conv(graph, node)
        if call is None or call.x_order[1] != 1:
            continue
        choose(node.name, [k for k in range(len(node.out_vars)) if call.y_order[k] in range(1, 2 + (call.groups > 1))])
        x = graph.node_of.get(call.input)  # the input (a pad, a relu) walks the same way
        if x is not None and len(x.out_vars) == 2 + len(call.stride):
            choose(x.name, [1])
    while queue:
        name = queue.popleft()
        node = graph.node_of[name]
        for reader in graph.consumers.get(name, ()):
            r = graph.node_of[reader]
            choose(reader, _classify(r.out_vars, [a for a in r.accesses if a.tensor == name], channels[name]))
        for producer in graph.producers(node):
            p = graph.node_of[producer]
            mine = {node.out_vars[k] for k in channels[name]}
            reads = [a for a in node.accesses if a.tensor == producer]
            choose(producer, _classify_axes(len(p.out_vars), reads, mine, set(node.out_vars)))
    return {name: tuple(k for k in range(len(graph.node_of[name].out_vars)) if k not in axes) + tuple(sorted(axes))
            for name, axes in channels.items()}


def _classify(out_vars, reads, channel_axes) -> list[int] | None:
    """The reader's channel axes: those whose variable appears only in the read's channel indices
    (None when a variable appears in both kinds, or a read does not index every axis)."""
    axes = []
    for k, v in enumerate(out_vars):
        kinds = {pos in channel_axes for a in reads for pos, idx in enumerate(a.indices) if v in free_vars(idx)}
        if len(kinds) != 1:
            return None
        if kinds == {True}:
            axes.append(k)
    return axes


def _classify_axes(rank: int, reads, channel_vars: set, out_vars: set) -> list[int] | None:
    """The producer's channel axes: those whose index in the read holds only the reader's channel
    variables (None when an index mixes kinds or holds none)."""
    axes = []
    for a in reads:
        if len(a.indices) != rank:
            return None
        for k, idx in enumerate(a.indices):
            used = free_vars(idx) & out_vars
            if not used or (used & channel_vars and used - channel_vars):
                return None
            if used <= channel_vars and k not in axes:
                axes.append(k)
    return sorted(axes)


def _permute_node(node: Node, perm: tuple[int, ...] | None) -> Node:
    if perm is None:
        return node
    out = node.dims[: len(node.index)]
    dims = tuple(out[k] for k in perm) + node.dims[len(node.index):]
    return dataclasses.replace(node, index=tuple(node.index[k] for k in perm), dims=dims)


def _reindex(node: Node, order: dict) -> Node:
    def read(a: Access):
        perm = order.get(a.tensor)
        return Read(a) if perm is None else Read(Access(a.tensor, tuple(a.indices[k] for k in perm)))

    if not any(a.tensor in order for a in node.accesses):
        return node
    return dataclasses.replace(node, body=map_reads(node.body, read))


def _permute_type(t: TensorType, perm: tuple[int, ...]) -> TensorType:
    return dataclasses.replace(t, shape=tuple(t.shape[k] for k in perm))
