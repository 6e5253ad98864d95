"""Region analysis for the gpu target: which nodes can be generated, and how a group of them
maps onto one kernel.

Every loop variable of every node is unified with the variables of the nodes it reads
(registers can only carry a value from producer to consumer when both index it the same
way), which gives the group's *axis classes*. The classes that the reductions reduce are the
*local* axes L, walked inside one program (whole, or in chunks); the others are the
*parallel* axes P, spread over programs. A group whose reductions reduce different axis sets,
or whose intermediates are read through index arithmetic, is refused here with a reason, and
the caller splits it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...ir.expr import Const, Read, reads
from ...ir.graph import Graph, Node
from ...ir.index import Div, Gather, Mod, Sum, Var, gathered_tensors
from ...ir.interpret import _product_factors

GENERATED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                    torch.int16, torch.int8, torch.uint8, torch.bool)


class NotStitchable(Exception):
    """A group of nodes that one generated kernel cannot run (the message says why)."""


def is_contraction(node: Node) -> bool:
    """A GEMM-like node: a sum of products of two different tensors that each keep an output
    variable the other lacks (M and N dims), e.g. Y[i,j] = sum_k A[i,k] * B[k,j]."""
    if node.reduce != "sum" or not node.reduce_vars or node.is_scatter:
        return False
    factors = _product_factors(node.body)
    if factors is None:
        return False
    accesses = [f.access for f in factors if isinstance(f, Read)]
    out = set(node.out_vars)
    for a in accesses:
        for b in accesses:
            if a.tensor == b.tensor:
                continue
            only_a = (a.vars - b.vars) & out
            only_b = (b.vars - a.vars) & out
            shared_red = a.vars & b.vars & set(node.reduce_vars)
            if only_a and only_b and shared_red:
                return True
    return False


def node_refusal(graph: Graph, node: Node) -> str | None:
    """Why `node` cannot be part of a generated kernel (None when it can)."""
    if node.is_scatter:
        return "scatter-add (runs through torch)"
    if is_contraction(node):
        return "contraction / GEMM (runs through torch until GEMM fusion lands)"
    types = [graph.type_of[t] for t in (*node.inputs, node.name)]
    if any(not t.format.is_dense for t in types):
        return "reads or writes a sparse tensor (runs through torch)"
    if any(t.dtype not in GENERATED_DTYPES for t in types):
        return "dtype without a generated path"
    return None


class _UnionFind:
    def __init__(self):
        self.parent: dict = {}

    def find(self, x):
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a, b):
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


@dataclass
class PartPlan:
    """One connected component of a group: the nodes of one tiled loop nest."""

    nodes: tuple[Node, ...]
    cls: dict  # (node name, var) -> class id
    extents: dict  # class id -> extent
    L: tuple  # local (reduced) classes, outer to inner
    P: tuple  # parallel classes, outer to inner
    stage: dict  # reduction name -> stage index; row-level node -> stage after which it is ready
    final_stage: int
    row_level: frozenset  # nodes whose value has no local axis (reductions, per-row math)
    outputs: tuple[str, ...]  # node outputs the part must store
    p_contiguous: bool  # the memory-contiguous class is parallel (column-reduction style)
    big_elem_bytes: int = 4
    notes: list = field(default_factory=list)

    @property
    def P_total(self) -> int:
        return _prod(self.extents[c] for c in self.P)

    @property
    def L_total(self) -> int:
        return _prod(self.extents[c] for c in self.L)

    @property
    def reductions(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.reduce)

    def classes_of(self, node: Node, vars_) -> set:
        return {self.cls[(node.name, v)] for v in vars_}


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def unify(graph: Graph, nodes) -> _UnionFind:
    """Axis classes: a consumer's variable and the producer variable it reads through a plain
    index are one class. Any other access of an intermediate cannot stay in registers."""
    names = {n.name for n in nodes}
    uf = _UnionFind()
    for n in nodes:
        for v, _ in n.dims:
            uf.find((n.name, v))
        for a in reads(n.body):
            if any(t in names for t in a.tensors - {a.tensor}):
                raise NotStitchable(f"{n.name} gathers through an intermediate of the group")
            if a.tensor not in names:
                continue
            producer = graph.node_of[a.tensor]
            if not all(isinstance(i, Var) for i in a.indices):
                raise NotStitchable(f"{n.name} reads {a} through index arithmetic")
            for pv, cv in zip(producer.out_vars, a.indices):
                uf.union((producer.name, pv), (n.name, cv.name))
    return uf


def components(graph: Graph, nodes, uf: _UnionFind) -> list[list[Node]]:
    """Groups of nodes that share an axis class (independent parts can be packed)."""
    owner: dict = {}
    groups: list[list[Node]] = []
    for n in nodes:
        roots = {uf.find((n.name, v)) for v, _ in n.dims}
        hits = sorted({owner[r] for r in roots if r in owner})
        if not hits:
            groups.append([n])
            g = len(groups) - 1
        else:
            g = hits[0]
            for other in hits[1:]:
                groups[g] += groups[other]
                for r, o in list(owner.items()):
                    if o == other:
                        owner[r] = g
                groups[other] = []
            groups[g].append(n)
        for r in roots:
            owner[r] = g
    order = {n.name: k for k, n in enumerate(nodes)}
    return [sorted(g, key=lambda n: order[n.name]) for g in groups if g]


def _inner_var(index) -> str | None:
    """The variable that moves fastest in an index expression (coefficient 1), if any."""
    if isinstance(index, Var):
        return index.name
    if isinstance(index, Sum):
        for c, a in index.terms:
            if c == 1 and isinstance(a, Var):
                return a.name
    if isinstance(index, Mod):
        return _inner_var(index.arg)
    return None


def _tensor_uses(graph: Graph, nodes):
    """(tensor name, numel, element bytes, index exprs, reading node) for every access and store."""
    for n in nodes:
        t = graph.type_of[n.name]
        yield n.name, _prod(t.shape), t.dtype.itemsize, n.index, n
        for a in reads(n.body):
            t = graph.type_of[a.tensor]
            yield a.tensor, _prod(t.shape), t.dtype.itemsize, a.indices, n


def class_strides(graph: Graph, nodes, cls) -> tuple[dict, int]:
    """Stride of each class in the largest tensor it indexes (contiguous layout assumed), used
    to order classes so that the innermost one moves fastest; and the largest element size."""
    best: dict = {}
    big_bytes = 1
    for tensor, numel, itemsize, index, n in sorted(_tensor_uses(graph, nodes), key=lambda u: -u[1] * u[2]):
        big_bytes = max(big_bytes, itemsize) if not best else big_bytes
        shape = graph.type_of[tensor].shape
        stride = 1
        for d in reversed(range(len(index))):
            v = _inner_var(index[d])
            if v is not None:
                c = cls[(n.name, v)]
                if c not in best:
                    best[c] = (numel, stride)
            stride *= shape[d]
    return best, big_bytes


def plan_part(graph: Graph, nodes: list[Node], uf: _UnionFind, outside_users: set) -> PartPlan:
    ids: dict = {}
    cls: dict = {}
    extents: dict = {}
    for n in nodes:
        for v, e in n.dims:
            c = ids.setdefault(uf.find((n.name, v)), len(ids))
            cls[(n.name, v)] = c
            if extents.setdefault(c, e) != e:
                raise NotStitchable(f"{n.name}: variable {v} has extent {e}, its class has {extents[c]}")
        if len({cls[(n.name, v)] for v, _ in n.dims}) != len(n.dims):
            raise NotStitchable(f"{n.name} indexes one axis twice (a diagonal)")
    red_sets = {frozenset(cls[(n.name, v)] for v in n.reduce_vars) for n in nodes if n.reduce}
    if len(red_sets) > 1:
        raise NotStitchable("reductions over different axes in one loop nest")
    strides, big_bytes = class_strides(graph, nodes, cls)
    order = sorted(extents, key=lambda c: -strides.get(c, (0, 1 << 62))[1])  # outer -> inner
    inner = min(strides, key=lambda c: (-strides[c][0], strides[c][1])) if strides else None
    if red_sets:
        (red,) = red_sets
        L = tuple(c for c in order if c in red)
    else:
        L = (inner,) if inner is not None else ()
    P = tuple(c for c in order if c not in L)
    stage, final, row_level = _stages(graph, nodes, cls, set(L))
    names = {n.name for n in nodes}
    outputs = tuple(n.name for n in nodes if n.name in outside_users)
    for n in nodes:
        for t in n.inputs:
            if t in names and graph.node_of[t].reduce and n.reduce and stage[t] >= stage[n.name]:
                raise NotStitchable("reduction order")
    return PartPlan(tuple(nodes), cls, extents, L, P, stage, final, frozenset(row_level), outputs,
                    p_contiguous=inner is not None and inner in P, big_elem_bytes=big_bytes)


def _stages(graph: Graph, nodes, cls, L: set):
    """Stage of each reduction (1 + stage of the reductions it needs), readiness of row-level
    nodes, and the final stage where full-space outputs are written."""
    need: dict = {}  # node -> first stage where its value can be computed
    stage: dict = {}
    row_level = set()
    names = {n.name for n in nodes}
    for n in nodes:
        deps = [t for t in n.inputs if t in names]
        ready = max((need[d] for d in deps), default=0)
        if n.reduce:
            stage[n.name] = ready
            need[n.name] = ready + 1
            row_level.add(n.name)
        else:
            need[n.name] = ready
            if not ({cls[(n.name, v)] for v in n.out_vars} & L):
                row_level.add(n.name)
                stage[n.name] = ready
    final = max((need[n.name] for n in nodes if n.reduce), default=0)
    return stage, final, row_level


def const_value(e) -> float | None:
    return e.value if isinstance(e, Const) else None


def gathers_in(index) -> bool:
    return bool(gathered_tensors(index)) or isinstance(index, (Div, Mod, Gather)) and False
