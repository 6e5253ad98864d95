"""Channels-last storage for the activations around convolutions.

cuDNN runs half-precision convolutions on tensor cores in NHWC; given NCHW tensors it transposes
them first, or picks slower kernels. This pass stores every convolution's output, and the
intermediates connected to it axis for axis (batch norm, relu, the residual add, padding,
pooling windows), with the channel axes last. It is a graph rewrite that changes no value: a
node's output axes are permuted, and every read of it indexes the permuted axes, so the
generated kernels walk the channels innermost and `match_conv` finds the convolutions over
channels-last inputs.

Parameters keep their order. Graph inputs and outputs keep theirs unless the caller says
otherwise: an input that arrives channels last (`input_orders`, e.g. an activation that a
training step's forward saved for its backward) is read as stored and spreads its order like a
convolution; an output whose layout nobody depends on (`free_outputs`, e.g. what the forward
saves for the backward) may leave permuted. The program hands such tensors over as permuted
views (`Captured.layouts`): the same shape, channels-last strides.

It rewrites the whole graph once, before its regions compile, so that the regions agree on how
an intermediate passed between them is stored.
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
    return channels_last_layouts(graph)[0]


def channels_last_layouts(graph: Graph, free_outputs=(), input_orders=None, last_outputs=()) -> tuple[Graph, dict]:
    """(the rewritten graph, {input or output name: the permutation of its axes as stored}).
    `last_outputs`: free outputs that a convolution outside reads (a training step's backward hands
    its gradients and recomputed activations to cuDNN's convolution backward), stored channels last."""
    # a convolution's weight keeps its axes whatever its strides: cuDNN reads it in either layout
    weights = {call.weight for node in graph.nodes if (call := match_conv(graph, node)) is not None}
    input_orders = {k: tuple(v) for k, v in (input_orders or {}).items() if k in graph.inputs and k not in weights}
    wanted = {}
    # a name, or (name, shape) where the output leaves as a view of that shape: a node returned both ways
    # takes the view's order (a plain leaf is a permuted view in any order)
    for out in sorted(last_outputs, key=lambda o: not isinstance(o, str)):
        name, shape = (out, None) if isinstance(out, str) else out
        if name in graph.node_of:
            perm = _view_last(graph.type_of[name].shape, shape or graph.type_of[name].shape)
            if perm is not None and perm != tuple(range(len(perm))):
                wanted[name] = perm
    free = (set(free_outputs) | set(wanted)) - set(graph.inputs)
    order = _choose(graph, free, {**wanted, **input_orders})
    if not order:
        return graph, {}
    nodes = tuple(_permute_node(_reindex(n, order), order.get(n.name)) for n in graph.nodes)
    types = tuple((name, _permute_type(t, order[name]) if name in order else t) for name, t in graph.types)
    ends = {name: order[name] for name in (*graph.inputs, *graph.outputs) if name in order}
    return dataclasses.replace(graph, nodes=nodes, types=types), ends


def _view_last(shape: tuple[int, ...], view: tuple[int, ...]) -> tuple[int, ...] | None:
    """The order to store a tensor of `shape` in so that its reshape to `view` (an image batch, 4 or 5
    dims) is channels last; None where no order does (a merged group holds channels and positions)."""
    if len(view) not in (4, 5):
        return None
    groups = _reshape_groups(tuple(shape), tuple(view))
    if groups is None:
        return None
    position = {axis: k for k, axis in enumerate((0, *range(2, len(view)), 1))}  # the view's axes as stored
    placed = []
    for axes, view_axes in groups:
        at = [position[v] for v in view_axes]
        if at != list(range(at[0], at[0] + len(at))):
            return None
        placed.append((at[0], axes))
    return tuple(axis for _, axes in sorted(placed) for axis in axes)


def _reshape_groups(shape: tuple[int, ...], view: tuple[int, ...]) -> list[tuple[list, list]] | None:
    """The runs of axes that a reshape from `shape` to `view` merges or splits, as (axes of shape,
    axes of view) pairs of equal size; axes of extent 1 at the end join the last run."""
    groups, i, j = [], 0, 0
    while i < len(shape) and j < len(view):
        axes, view_axes, a, b = [i], [j], shape[i], view[j]
        i, j = i + 1, j + 1
        while a != b:
            if a < b and i < len(shape):
                axes.append(i)
                a, i = a * shape[i], i + 1
            elif b < a and j < len(view):
                view_axes.append(j)
                b, j = b * view[j], j + 1
            else:
                return None
        groups.append((axes, view_axes))
    rest = [shape[k] for k in range(i, len(shape))] + [view[k] for k in range(j, len(view))]
    if not groups or any(e != 1 for e in rest):
        return None
    groups[-1][0].extend(range(i, len(shape)))
    groups[-1][1].extend(range(j, len(view)))
    return groups


def _choose(graph: Graph, free_outputs: set = frozenset(), input_orders: dict | None = None) -> dict[str, tuple[int, ...]]:
    """node (or input) -> the permutation of its output axes (new axis k is old axis perm[k]);
    `input_orders` seeds it (inputs that arrive permuted, outputs wanted so)."""
    keep = set(graph.outputs) - set(free_outputs)
    order: dict[str, tuple[int, ...]] = dict(input_orders or {})
    queue: deque = deque(order)
    for node in graph.nodes:
        call = match_conv(graph, node)
        if call is None or node.name in keep or call.x_order[1] != 1:
            continue
        channels = [k for k in range(len(node.out_vars)) if call.y_order[k] in range(1, 2 + (call.groups > 1))]
        perm = tuple(k for k in range(len(node.out_vars)) if k not in channels) + tuple(channels)
        order[node.name] = perm
        queue.append(node.name)
        x = graph.node_of.get(call.input)  # the input (a pad, a relu) walks the same way
        if x is not None and x.name not in keep and x.name not in order and len(x.out_vars) == 2 + len(call.stride):
            order[x.name] = tuple(k for k in range(len(x.out_vars)) if k != 1) + (1,)
            queue.append(x.name)
    while queue:  # spread to the neighbours that are aligned axis for axis
        name = queue.popleft()
        for other in _aligned_neighbours(graph, name):
            if other not in order and other not in keep:
                order[other] = order[name]
                queue.append(other)
    return order


def _aligned_neighbours(graph: Graph, name: str):
    """Nodes of the same rank that read `name`, or that `name` reads, with their own k-th output
    variable in the k-th index of the read (elementwise, shifted, windowed)."""
    for reader in graph.consumers.get(name, ()):
        if _aligned(graph.node_of[reader], name):
            yield reader
    node = graph.node_of.get(name)
    if node is None:  # an input
        return
    for producer in graph.producers(node):
        if len(graph.node_of[producer].out_vars) == len(node.out_vars) and _aligned(node, producer):
            yield producer


def _aligned(node: Node, tensor: str) -> bool:
    accesses = [a for a in node.accesses if a.tensor == tensor]
    out = node.out_vars
    if not accesses or node.is_scatter:
        return False
    for a in accesses:
        if len(a.indices) != len(out):
            return False
        for k, idx in enumerate(a.indices):
            if free_vars(idx) & set(out) != {out[k]}:
                return False
    return True


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
