"""Compute chains in the IR, recognised: GEMM → elementwise → GEMM (gated FFNs included), and single GEMMs
followed by a bias add, an activation and a residual add.

A chain is a contraction C1 (out[rows..., j] = sum_k A[rows..., k] * B[k, j], B 2-D in either
orientation), elementwise nodes over C1's output (a bias add, one activation, and for the gated
FFN a product with a second contraction C1' that shares A), then a contraction C2 whose reduce
variable runs over the intermediate's last index: E = act(A·B + b)·D. `match_gemm_epilogues`
finds single GEMMs followed by bias / activation / residual nodes. chains.py runs what these find.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...ir.expr import Call, Read, reads
from ...ir.graph import Graph, Node
from ...ir.index import Lit, Var, evaluate, free_vars, gathered_tensors
from . import chain_cost

ACT_TAGS = {"gelu", "silu", "relu", "sigmoid"}


@dataclass(frozen=True)
class Contraction:
    node: str
    a: str
    w: str
    w_transposed: bool  # weight accessed as w[j, k] (a linear layer's weight)


@dataclass(frozen=True)
class ChainSpec:
    nodes: tuple[str, ...]
    first: Contraction
    second: Contraction | None       # None: a single GEMM with an epilogue
    up: Contraction | None = None    # the gated FFN's second GEMM1
    bias1: str | None = None
    biasu: str | None = None
    act: str = "none"
    residual: str | None = None      # single GEMM only: + R[rows..., j]


def dense_contraction(graph: Graph, node: Node) -> Contraction | None:
    """A contraction whose activations are stored dense, in float32 or narrower: a sparse A (a graph's adjacency,
    after reassociate.py put it first) is a sparse product, not a GEMM."""
    c = _contraction(graph, node)
    if c is None or not graph.type_of[c.a].format.is_dense:
        return None
    if torch.float64 in {graph.type_of[t].dtype for t in (c.a, c.w, node.name)}:
        return None  # the Triton GEMMs multiply in float32 at most; float64 stays with torch's (cuBLAS's DGEMM)
    return c if all(reads_whole(graph, node, a) for a in reads(node.body) if a.tensor == c.w) else None


def reads_whole(graph: Graph, node: Node, access) -> bool:
    """The access covers its tensor: the kernels take whole tensors, and x[:, :4] @ w reads part of x."""
    names = plain_names(graph, access)
    shape = [n for i, n in zip(access.indices, graph.type_of[access.tensor].shape) if not _unit_zero(i, n)]
    return names is not None and tuple(shape) == tuple(node.extents[n] for n in names)


def reads_rows(graph: Graph, node: Node, access, names: tuple[str, ...]) -> bool:
    """Whether `access` reads its whole tensor, row-major, as a tensor of `names`' extents read at `names` would be,
    with the last axis its own: the kernels' reshape(-1, K) of it is free. `x.view(-1, d)` reads x[i // t, i % t, k],
    a batch of one x[0, i, k]. Each index depends on one variable at most, so the address is a sum of one function
    per variable, each checked over its extent."""
    shape = graph.type_of[access.tensor].shape
    extents = [node.extents[n] for n in names]
    if access.is_plain:  # the common case, without evaluating anything
        return tuple(i.name for i in access.indices) == names and tuple(shape) == tuple(extents)
    if shape[-1] != extents[-1] or math.prod(shape) != math.prod(extents) or access.vars != set(names):
        return False
    if any(len(free_vars(i)) > 1 or gathered_tensors(i) for i in access.indices):
        return False
    strides = [math.prod(shape[c + 1:]) for c in range(len(shape))]
    if sum(i.value * s for i, s in zip(access.indices, strides) if isinstance(i, Lit)):
        return False
    for d, name in enumerate(names):
        at = torch.arange(extents[d])
        address = sum(evaluate(i, {name: at}, {}) * s for i, s in zip(access.indices, strides) if name in free_vars(i))
        if not torch.equal(address, at * math.prod(extents[d + 1:])):
            return False
    return True


def plain_names(graph: Graph, access) -> tuple[str, ...] | None:
    """The variables of an access that is plain once the zeros it reads size-1 dimensions at are dropped (a batch
    of one, which a flattening view turns into x[0, i, k]); None where it is not. The kernels reshape their
    operands to matrices, so the dropped axes cost nothing."""
    shape = graph.type_of[access.tensor].shape
    kept = [i for i, n in zip(access.indices, shape) if not _unit_zero(i, n)]
    if not all(isinstance(i, Var) for i in kept) or len({i.name for i in kept}) != len(kept):
        return None
    return tuple(i.name for i in kept)


def _unit_zero(index, size: int) -> bool:
    return index == Lit(0) and size == 1


def _contraction(graph: Graph, node: Node) -> Contraction | None:
    """out[r..., j] = sum_k A[r..., k] * W[k, j] or W[j, k], one reduce variable; W read plainly, A read whole
    in row-major order (`reads_rows`)."""
    if node.reduce != "sum" or node.is_scatter or len(node.reduce_vars) != 1:
        return None
    body = node.body
    if not (isinstance(body, Call) and body.op == "mul" and all(isinstance(x, Read) for x in body.args)):
        return None
    k = node.reduce_vars[0]
    out = node.out_vars
    if len(out) != len(node.index) or len(out) < 2:
        return None
    (x, y) = (arg.access for arg in body.args)
    for a, w in ((x, y), (y, x)):
        if not (w.is_plain and len(w.indices) == 2) or not reads_rows(graph, node, a, out[:-1] + (k,)):
            continue
        w_names = tuple(i.name for i in w.indices)
        if w_names in ((k, out[-1]), (out[-1], k)):
            return Contraction(node.name, a.tensor, w.tensor, w_names == (out[-1], k))
    return None


def _only_consumer(graph: Graph, tensor: str) -> str | None:
    users = graph.consumers.get(tensor, ())
    return users[0] if len(set(users)) == 1 and tensor not in graph.outputs else None


def _same_point(node: Node, access) -> bool:
    return access.is_plain and tuple(i.name for i in access.indices) == node.out_vars


def _classify(graph: Graph, node: Node, value: str):
    """What an elementwise node does to `value` (the chain so far): ('bias', vec), ('act', name),
    ('mul', other tensor), ('add', matrix); None when it is something else."""
    if node.reduce is not None or node.is_scatter:
        return None
    if not all(isinstance(i, Var) for i in node.index):
        return None
    if node.tag is not None and node.tag.kind in ACT_TAGS and node.inputs == (value,):
        text = str(node.body)
        if node.tag.kind == "gelu":
            return ("act", "gelu_tanh" if "tanh" in text else "gelu") if ("erf" in text or "tanh" in text) else None
        return "act", node.tag.kind
    body = node.body
    if isinstance(body, Call) and body.op in ("relu", "sigmoid") and isinstance(body.args[0], Read):
        if body.args[0].access.tensor == value and _same_point(node, body.args[0].access):
            return "act", body.op
    if isinstance(body, Call) and body.op in ("add", "mul") and all(isinstance(x, Read) for x in body.args):
        accs = [x.access for x in body.args]
        mine = [a for a in accs if a.tensor == value and _same_point(node, a)]
        other = [a for a in accs if a.tensor != value]
        if len(mine) != 1 or len(other) != 1 or not reads_whole(graph, node, other[0]):
            return None
        names = plain_names(graph, other[0])
        if body.op == "add" and names == node.out_vars[-1:]:
            return "bias", other[0].tensor
        if names == node.out_vars:
            return ("add" if body.op == "add" else "mul"), other[0].tensor
    return None


def _walk_elementwise(graph: Graph, start: str):
    """Follow single-consumer elementwise nodes from `start`; yields (node, classification)."""
    value = start
    while True:
        user = _only_consumer(graph, value)
        if user is None:
            return
        node = graph.node_of[user]
        kind = _classify(graph, node, value)
        if kind is None:
            return
        yield node, kind
        value = node.name


def _up_branch(graph: Graph, tensor: str, a: str):
    """The gated FFN's up projection: C1'(A) optionally followed by a bias add."""
    nodes, bias = [], None
    node = graph.node_of.get(tensor)
    if node is not None and node.reduce is None:
        kind = _classify(graph, node, node.inputs[0]) if node.inputs else None
        if kind is None or kind[0] != "bias":
            return None
        bias, nodes = kind[1], [node.name]
        node = graph.node_of.get(node.inputs[0])
    c = dense_contraction(graph, node) if node is not None else None
    if c is None or c.a != a or any(_only_consumer(graph, n) is None for n in [c.node] + nodes):
        return None
    return c, bias, [c.node] + nodes


def _match_from(graph: Graph, c1: Contraction) -> ChainSpec | None:
    spec = dict(bias1=None, biasu=None, act="none", up=None)
    nodes, value, up_nodes = [c1.node], c1.node, []
    for node, (kind, arg) in _walk_elementwise(graph, c1.node):
        if kind == "bias" and spec["act"] == "none" and spec["bias1"] is None:
            spec["bias1"] = arg
        elif kind == "act" and spec["act"] == "none":
            spec["act"] = arg
        elif kind == "mul" and spec["up"] is None and spec["act"] != "none":
            branch = _up_branch(graph, arg, c1.a)
            if branch is None:
                break
            spec["up"], spec["biasu"], up_nodes = branch
        else:
            break
        nodes.append(node.name)
        value = node.name
    user = _only_consumer(graph, value)
    c2 = dense_contraction(graph, graph.node_of[user]) if user is not None else None
    if c2 is None or c2.a != value or len(nodes) == 1:
        return None
    ordered = tuple(n.name for n in graph.nodes if n.name in set(nodes + up_nodes + [c2.node]))
    return ChainSpec(ordered, c1, c2, **spec)


def match_chains(graph: Graph) -> list[tuple[str, ...]]:
    """Node-name tuples (graph order) of every GEMM → elementwise → GEMM chain, gated ones included."""
    found, taken = [], set()
    for node in graph.nodes:
        c1 = dense_contraction(graph, node)
        if c1 is None or node.name in taken:
            continue
        spec = _match_from(graph, c1)
        if spec is not None and not taken & set(spec.nodes):
            found.append(spec.nodes)
            taken |= set(spec.nodes)
    return found


def match_gemm_epilogues(graph: Graph, chains=()) -> list[tuple[str, ...]]:
    """GEMM followed by any of: bias add, one activation, residual add (in that order), beside the
    `chains` already matched. Only a chain's last node is stored, so no two chains share a node, no
    residual is a node inside another chain, and a value one chain reads as its residual is no
    chain's inner node: GraphSAGE's x·Ws + (A·x)·Wn once matched both GEMMs with the same add,
    and one of them was never computed."""
    found, taken = [], {n for c in chains for n in c}
    unstored, read = {n for c in chains for n in c[:-1]}, set()
    for node in graph.nodes:
        c = dense_contraction(graph, node)
        if c is None or node.name in taken or node.name in read:
            continue
        spec = _epilogue_spec(graph, c, stop=taken, unstored=unstored)
        inner = [i for i, name in enumerate(spec.nodes[:-1]) if name in read]
        if inner:
            spec = _epilogue_spec(graph, c, limit=inner[0] + 1)
        if len(spec.nodes) > 1:
            found.append(spec.nodes)
            taken |= set(spec.nodes)
            unstored |= set(spec.nodes[:-1])
            read |= {spec.residual} - {None}
    return found


def _epilogue_spec(graph: Graph, c: Contraction, limit: int | None = None, stop=frozenset(),
                   unstored=frozenset()) -> ChainSpec:
    """The longest epilogue after GEMM `c` (at most `limit` nodes with the GEMM), ending before a
    node in `stop` or an add whose other operand is in `unstored` (computed inside another chain)."""
    spec = dict(bias1=None, act="none", residual=None)
    nodes = [c.node]
    for node, (kind, arg) in _walk_elementwise(graph, c.node):
        if node.name in stop or (limit is not None and len(nodes) >= limit):
            break
        if kind == "bias" and spec["bias1"] is None and spec["act"] == "none" and spec["residual"] is None:
            spec["bias1"] = arg
        elif kind == "act" and spec["act"] == "none" and spec["residual"] is None:
            spec["act"] = arg
        elif kind == "add" and spec["residual"] is None and arg not in unstored:
            spec["residual"] = arg
        else:
            break
        nodes.append(node.name)
    return ChainSpec(tuple(nodes), c, None, **spec)


def chain_shape(graph: Graph, names) -> chain_cost.ChainShape | None:
    """The chain's shape from the graph's types (None for a single GEMM with an epilogue)."""
    spec = spec_for(graph, names)
    if spec.second is None:
        return None
    a = graph.type_of[spec.first.a]
    w1, w2 = graph.type_of[spec.first.w].shape, graph.type_of[spec.second.w].shape
    K, N = (w1[1], w1[0]) if spec.first.w_transposed else w1
    L = w2[0] if spec.second.w_transposed else w2[1]
    M = 1
    for d in a.shape[:-1]:
        M *= d
    return chain_cost.ChainShape(M, K, N, L, a.dtype.itemsize, spec.up is not None, spec.act)


def spec_for(graph: Graph, names) -> ChainSpec:
    names = tuple(names)
    c1 = _contraction(graph, graph.node_of[names[0]])
    if c1 is None:
        raise ValueError(f"{names[0]} is not a contraction over a 2-D weight")
    spec = _match_from(graph, c1)
    if spec is None or set(spec.nodes) != set(names):
        spec = _epilogue_spec(graph, c1, limit=len(names))
    if set(spec.nodes) != set(names):
        raise ValueError(f"nodes {names} are not a chain this target fuses (matched {spec.nodes})")
    return spec
