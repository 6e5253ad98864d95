"""Random IR graphs for planner tests: square [n, n] tensors, a sparse (CSR) and a dense input,
elementwise, transposed and contraction nodes over earlier tensors."""

from __future__ import annotations

import torch

from stitchflow.ir.expr import Access, Call, Read
from stitchflow.ir.graph import Graph, Node
from stitchflow.ir.index import Var
from stitchflow.ir.types import TensorType, dense, parse_format

I, J, K = Var("i"), Var("j"), Var("k")
KINDS = ("add", "mul", "relu", "exp", "matmul", "tadd")


def read(t, *idx):
    return Read(Access(t, tuple(idx)))


def make_node(name: str, kind: str, a: str, b: str, n: int) -> Node:
    dims2 = (("i", n), ("j", n))
    if kind == "add":
        return Node(name, (I, J), Call("add", (read(a, I, J), read(b, I, J))), dims2)
    if kind == "mul":
        return Node(name, (I, J), Call("mul", (read(a, I, J), read(b, I, J))), dims2)
    if kind in ("relu", "exp"):
        return Node(name, (I, J), Call(kind, (read(a, I, J),)), dims2)
    if kind == "tadd":
        return Node(name, (I, J), Call("add", (read(a, J, I), read(b, I, J))), dims2)
    return Node(name, (I, J), Call("mul", (read(a, I, K), read(b, K, J))), dims2 + (("k", n),), reduce="sum")


def build(spec, n: int = 6) -> Graph:
    """spec: [(kind, operand a, operand b)] where operands index [inputs..., earlier nodes...]."""
    inputs = ("a", "x")
    types = {"a": TensorType((n, n), torch.float32, parse_format("csr", 2)),
             "x": TensorType((n, n), torch.float32, dense(2))}
    names = list(inputs)
    nodes = []
    for k, (kind, ia, ib) in enumerate(spec):
        name = f"t{k}"
        nodes.append(make_node(name, kind, names[ia % len(names)], names[ib % len(names)], n))
        types[name] = TensorType((n, n), torch.float32, dense(2))
        names.append(name)
    used = {t for node in nodes for t in node.inputs}
    outputs = tuple(nd.name for nd in nodes if nd.name not in used) or (nodes[-1].name,)
    return Graph(inputs, (), tuple(nodes), outputs, tuple(types.items())).validate()


def chain(kinds, n: int = 6) -> Graph:
    """Each node reads the previous one (and the sparse input for binary ops): a chain."""
    return build([(kind, 2 + k - 1 if k else 1, 0) for k, kind in enumerate(kinds)], n)


class TwoContractions:
    """A target that refuses regions with more than two contractions (to exercise legality)."""

    name = "two-contractions"

    def check_region(self, graph, region):
        count = sum(1 for n in region.nodes if graph.node_of[n].reduce)
        return f"{count} contractions in one region; this target fits two" if count > 2 else None
