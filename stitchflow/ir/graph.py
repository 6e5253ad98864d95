"""Nodes, graphs and fusion regions.

A node is one index-notation equation, e.g. `Y[i,j] = sum_k A[i,k] * X[k,j]`: its output access,
an elementwise body, an optional reduction (sum or max) over the variables that are not output
variables, and the extent of every variable. A scatter (an output index that is not plain variables,
`out[dst[e], f] += msg[e, f]`) starts at its reduction's identity and combines every loop point's value
into the position it names: by sum, product, maximum or minimum. A graph is a DAG of nodes over named
tensors, like a jaxpr: inputs, parameters (constant tensors the program holds), equations, outputs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from .errors import ShapeError
from .expr import Access, Expr, body_vars, reads
from .index import IndexExpr, Var, free_vars, gathered_tensors
from .types import TensorType

REDUCTIONS = ("sum", "max", "prod")
SCATTER_REDUCTIONS = (*REDUCTIONS, "min")  # scatter_reduce's amin: a minimum kept at scattered positions
SCATTER_OPS = {"sum": "+=", "max": "max=", "min": "min=", "prod": "*="}


@dataclass(frozen=True)
class Tag:
    """Marks the nodes a composite op (softmax, layernorm, linear, ...) was decomposed into."""

    kind: str
    id: int

    def __str__(self) -> str:
        return f"{self.kind}#{self.id}"


@dataclass(frozen=True)
class Node:
    name: str
    index: tuple[IndexExpr, ...]
    body: Expr
    dims: tuple[tuple[str, int], ...]
    reduce: str | None = None
    tag: Tag | None = None
    origin: str = ""  # the torch op (FX node) this equation came from
    group: str = ""  # the top-level submodule that called it ("" at the top level)

    def __post_init__(self):
        known = SCATTER_REDUCTIONS if self.is_scatter else REDUCTIONS
        if self.reduce is not None and self.reduce not in known:
            raise ValueError(f"unknown reduction {self.reduce!r}")
        declared = {v for v, _ in self.dims}
        used = self.loop_vars_used
        if not used <= declared:
            raise ShapeError(f"node {self.name}: variables {sorted(used - declared)} have no extent")

    @functools.cached_property
    def extents(self) -> dict[str, int]:
        return dict(self.dims)

    @property
    def out_vars(self) -> tuple[str, ...]:
        """Variables that index the output directly, in output order."""
        return tuple(i.name for i in self.index if isinstance(i, Var))

    @property
    def reduce_vars(self) -> tuple[str, ...]:
        """Variables summed (or maxed) away: every variable that is not a plain output index."""
        out = set(self.out_vars)
        return tuple(v for v, _ in self.dims if v not in out)

    @functools.cached_property
    def is_scatter(self) -> bool:
        return not all(isinstance(i, Var) for i in self.index)

    @property
    def loop_vars_used(self) -> frozenset[str]:
        out = frozenset().union(*(free_vars(i) for i in self.index))
        return out | body_vars(self.body)

    @functools.cached_property
    def accesses(self) -> tuple[Access, ...]:
        return reads(self.body)

    @functools.cached_property  # a node is immutable; planners ask for its inputs tens of thousands of times
    def inputs(self) -> tuple[str, ...]:
        """Tensors this node reads (gathered index tensors included), first-use order, unique."""
        names: list[str] = []
        for a in self.accesses:
            for t in (a.tensor, *sorted(a.tensors - {a.tensor})):
                if t not in names:
                    names.append(t)
        for i in self.index:
            for t in sorted(gathered_tensors(i)):
                if t not in names:
                    names.append(t)
        return tuple(names)

    def __str__(self) -> str:
        lhs = f"{self.name}[{','.join(map(str, self.index))}]"
        op = SCATTER_OPS[self.reduce] if self.is_scatter else "="
        red = f"{self.reduce}_{','.join(self.reduce_vars)} " if self.reduce and self.reduce_vars and not self.is_scatter else ""
        notes = [str(self.tag)] if self.tag else []
        if self.group:
            notes.append(f"@{self.group}")
        tail = f"  # {' '.join(notes)}" if notes else ""
        return f"{lhs} {op} {red}{self.body}{tail}"


@dataclass(frozen=True)
class Graph:
    inputs: tuple[str, ...]
    params: tuple[str, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]
    types: tuple[tuple[str, TensorType], ...]

    @functools.cached_property
    def type_of(self) -> dict[str, TensorType]:
        return dict(self.types)

    @functools.cached_property
    def node_of(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    @functools.cached_property
    def consumers(self) -> dict[str, tuple[str, ...]]:
        users: dict[str, list[str]] = {name: [] for name, _ in self.types}
        for n in self.nodes:
            for t in n.inputs:
                users.setdefault(t, []).append(n.name)
        return {k: tuple(v) for k, v in users.items()}

    def producers(self, node: Node) -> tuple[str, ...]:
        """Names of the nodes whose outputs `node` reads (graph inputs and params excluded)."""
        return tuple(t for t in node.inputs if t in self.node_of)

    def validate(self) -> "Graph":
        known = set(self.inputs) | set(self.params)
        for n in self.nodes:
            missing = [t for t in n.inputs if t not in known]
            if missing:
                raise ShapeError(f"node {n.name} reads {missing} before they are defined")
            if n.name in known:
                raise ShapeError(f"tensor {n.name} is defined twice")
            out_type = self.type_of[n.name]
            if len(n.index) != out_type.rank:
                raise ShapeError(f"node {n.name}: {len(n.index)} indices for a rank-{out_type.rank} output")
            for i, size in zip(n.index, out_type.shape):
                # a scatter may write part of a dim (torch.scatter's index smaller than the output)
                if isinstance(i, Var) and (n.extents[i.name] > size if n.is_scatter else n.extents[i.name] != size):
                    raise ShapeError(f"node {n.name}: variable {i} has extent {n.extents[i.name]}, output dim {size}")
            known.add(n.name)
        for o in self.outputs:
            if o not in known:
                raise ShapeError(f"output {o} is never defined")
        return self

    def __str__(self) -> str:
        def decl(names):
            return ", ".join(f"{n}: {self.type_of[n]}" for n in names)

        lines = [f"graph({decl(self.inputs)})"]
        if self.params:
            lines.append(f"  params {decl(self.params)}")
        lines += [f"  {n}" for n in self.nodes]
        lines.append(f"  return {', '.join(self.outputs)}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Region:
    """A fusion region: a set of nodes that one target runs as one kernel (or dataflow graph)."""

    name: str
    nodes: tuple[str, ...]
    reason: str = field(default="", compare=False)

    def __str__(self) -> str:
        return f"{self.name}: {{{', '.join(self.nodes)}}}"
