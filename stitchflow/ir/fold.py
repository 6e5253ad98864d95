"""Folding nodes computed from coordinates alone (an arange, an identity matrix, a causal mask) into
constant inputs, for a target that streams tensors and has no coordinate values to compute them from."""

from __future__ import annotations

import torch

from .expr import index_values
from .graph import Graph, Node
from .interpret import eval_node


def reads_coordinates_only(node: Node) -> bool:
    return not node.inputs and bool(index_values(node.body))


def fold_coordinate_nodes(graph: Graph, params: dict[str, torch.Tensor]) -> tuple[Graph, dict[str, torch.Tensor]]:
    """The graph with those nodes turned into params (their values computed once), and the params."""
    folded = {n.name: eval_node(n, {}, graph.type_of[n.name]) for n in graph.nodes if reads_coordinates_only(n)}
    if not folded:
        return graph, params
    nodes = tuple(n for n in graph.nodes if n.name not in folded)
    return Graph(graph.inputs, graph.params + tuple(folded), nodes, graph.outputs, graph.types).validate(), params | folded
