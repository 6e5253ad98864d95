"""Activations: their bodies, and the same functions written out by hand, recognised.

`BODIES` holds the one body each activation lowers to (the frontend's F.gelu and F.silu use them).
Models often write an activation as several ops instead: GPT-2's
`0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))`, BERT's original
`x * 0.5 * (1 + erf(x / sqrt(2)))`, `x * sigmoid(x)` or `x / (1 + exp(-x))`. Each op is a node,
so the matchers of GEMM epilogues and chains (which take one activation node after a GEMM) do
not see an activation there, and cuBLASLt's epilogue or a fused chain cannot take it.

`recognise_activations` finds each such cone of elementwise nodes over one value x (every inner
node read only inside the cone, none an output) and evaluates it in float64 on points from -20
to 20: where it equals an activation to 1e-9 relative, the cone becomes that activation's node,
tagged as the frontend tags it. The values are the same function; in half precision they are
rounded once instead of after every op, as a fused kernel of the written-out ops also rounds.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from .expr import Access, Call, Cast, Const, Expr, IndexValue, Read, call, index_values, map_reads, reads
from .graph import Graph, Node, Tag
from .index import Var
from .interpret import eval_node
from .types import LOW_PRECISION, dense_type


def _gelu(a: Expr) -> Expr:
    inner = call("erf", call("mul", a, Const(1 / math.sqrt(2))))
    return call("mul", call("mul", Const(0.5), a), call("add", Const(1.0), inner))


def _gelu_tanh(a: Expr) -> Expr:
    cubic = call("add", a, call("mul", Const(0.044715), call("pow", a, Const(3))))
    inner = call("mul", Const(math.sqrt(2 / math.pi)), cubic)
    return call("mul", call("mul", Const(0.5), a), call("add", Const(1.0), call("tanh", inner)))


def _silu(a: Expr) -> Expr:
    return call("mul", a, call("sigmoid", a))


# name: (the tag the frontend gives it, its body over one operand, the function in torch)
BODIES = {
    "gelu": ("gelu", _gelu, F.gelu),
    "gelu_tanh": ("gelu", _gelu_tanh, lambda x: F.gelu(x, approximate="tanh")),
    "silu": ("silu", _silu, F.silu),
}
SAMPLES = torch.cat([torch.linspace(-20.0, 20.0, 4001, dtype=torch.float64), torch.tensor([-1e-3, 1e-3, 0.5, -0.5])])
TOLERANCE = 1e-9
TRANSCENDENTAL = {"tanh", "erf", "sigmoid", "exp"}  # one of which each activation here applies


MOST_NODES = 16  # a written-out activation takes a handful of ops; the cones tried stay small


def recognise_activations(graph: Graph) -> Graph:
    """The graph with every written-out activation as the activation's node (the graph itself if none)."""
    changed, dropped = {}, set()
    position = {n.name: k for k, n in enumerate(graph.nodes)}
    for node in reversed(graph.nodes):
        if node.name in dropped or not _elementwise(node) or not _products(node.body):
            continue
        found = _recognised(graph, node, position)
        if found is not None:
            kind, x, cone = found
            changed[node.name] = kind, x
            dropped |= cone - {node.name}
    if not changed:
        return graph
    next_id = 1 + max((n.tag.id for n in graph.nodes if n.tag is not None), default=0)
    nodes = []
    for n in graph.nodes:
        if n.name in dropped:
            continue
        if n.name in changed:
            kind, x = changed[n.name]
            n, next_id = _activation_node(graph, n, kind, x, Tag(BODIES[kind][0], next_id)), next_id + 1
        nodes.append(n)
    types = tuple((t, ty) for t, ty in graph.types if t not in dropped)
    return dataclasses.replace(graph, nodes=tuple(nodes), types=types).validate()


def _elementwise(node: Node) -> bool:
    return node.reduce is None and not node.is_scatter and not node.reduce_vars and not index_values(node.body)


def _cone(graph: Graph, node: Node, stop: str | None = None) -> set[str]:
    """`node` and the elementwise nodes above it (not above `stop`) that only the cone reads, each over the
    same point; at most MOST_NODES of them."""
    cone, grown = {node.name}, True
    while grown and len(cone) < MOST_NODES:
        grown = False
        for name in list(cone):
            for t in graph.node_of[name].inputs:
                producer = graph.node_of.get(t)
                if producer is None or t in cone or t == stop or t in graph.outputs or not _elementwise(producer):
                    continue
                if producer.index != node.index or producer.dims != node.dims:
                    continue
                if all(user in cone for user in graph.consumers[t]) and len(cone) < MOST_NODES:
                    cone.add(t)
                    grown = True
    return cone


def _products(e: Expr) -> bool:
    """Whether e is x times (or over) something, as every activation here is: a cheap test first."""
    while isinstance(e, Cast):
        e = e.arg
    return isinstance(e, Call) and e.op in ("mul", "div")


def _recognised(graph: Graph, node: Node, position: dict) -> tuple[str, str, set[str]] | None:
    """(the activation, the value it applies to, the nodes that compute it) where a cone ending at `node`
    computes an activation of one value read at the node's point; the nearest such value first."""
    widest = _cone(graph, node)
    values = {t for name in widest for t in graph.node_of[name].inputs} | widest - {node.name}
    for x in sorted(values, key=lambda t: -position.get(t, -1)):
        cone = _cone(graph, node, stop=x)
        kind = _activation_of(graph, node, cone, x)
        if kind is not None:
            return kind, x, cone
    return None


def _activation_of(graph: Graph, node: Node, cone: set[str], x: str) -> str | None:
    """The activation the cone computes of x, if it computes one."""
    body = _inlined(graph, node.body, cone, node.index)
    if body is None or not _ops(body) & TRANSCENDENTAL:
        return None
    read = reads(body)
    if len(read) < 2 or {a.tensor for a in read} != {x} or any(a.indices != node.index for a in read):
        return None  # every activation here reads x twice: x times a function of x
    dtype = graph.type_of[node.name].dtype
    if not dtype.is_floating_point or any(graph.type_of[t].dtype != dtype for t in cone | {x}):
        return None
    if graph.type_of[x].shape != graph.type_of[node.name].shape:
        return None
    values = _evaluate(body, x)
    if values is None:
        return None
    for kind, (tag, _, fn) in BODIES.items():
        expected = fn(SAMPLES)
        if torch.all((values - expected).abs() <= TOLERANCE * (1 + expected.abs())):
            return None if node.tag is not None and len(cone) == 1 and node.tag.kind == tag else kind
    return None


def _inlined(graph: Graph, e: Expr, cone: set[str], point) -> Expr | None:
    """e with every read of a cone node (at `point`, the cone's one point) replaced by that node's body;
    casts between floats dropped (the function is compared in float64); None where anything else stands."""
    if isinstance(e, Read):
        if e.access.tensor not in cone:
            return e
        return _inlined(graph, graph.node_of[e.access.tensor].body, cone, point) if e.access.indices == point else None
    if isinstance(e, Cast):
        return _inlined(graph, e.arg, cone, point) if e.dtype.is_floating_point else None
    if isinstance(e, Call):
        args = [_inlined(graph, a, cone, point) for a in e.args]
        return None if any(a is None for a in args) else Call(e.op, tuple(args))
    return None if isinstance(e, IndexValue) else e


def _ops(e: Expr) -> set[str]:
    if isinstance(e, Call):
        return {e.op}.union(*(_ops(a) for a in e.args))
    return _ops(e.arg) if isinstance(e, Cast) else set()


def _evaluate(body: Expr, x: str) -> torch.Tensor | None:
    """The body, with every read of x reading the samples, in float64."""
    flat = map_reads(body, lambda a: Read(dataclasses.replace(a, indices=(Var("v"),))))
    probe = Node("probe", (Var("v"),), flat, (("v", len(SAMPLES)),))
    try:
        return eval_node(probe, {x: SAMPLES}, dense_type((len(SAMPLES),), torch.float64))
    except (RuntimeError, TypeError, ValueError):
        return None


def _activation_node(graph: Graph, node: Node, kind: str, x: str, tag: Tag) -> Node:
    """The node the frontend lowers the activation to, in place of the cone's last node (its name, its point)."""
    read = Read(Access(x, node.index))
    operand = Cast(torch.float32, read) if graph.type_of[x].dtype in LOW_PRECISION else read
    return dataclasses.replace(node, body=BODIES[kind][1](operand), tag=tag)
