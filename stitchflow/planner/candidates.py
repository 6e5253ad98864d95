"""Candidate fusion regions: connected, convex sets of IR nodes, each judged by the target.

Connected means connected in the producer -> consumer DAG taken undirected; convex means no path
leaves the set and comes back, so that any partition into convex sets whose quotient is acyclic
can run region after region. Small graphs get every connected convex set (exact planning);
larger ones a bounded family: sets grown from each node up to a few nodes, the contiguous
connected slices of a topological order (chains, layers), and the per-op and per-layer groups
and their unions, so that unfused, per-layer and full fusion are always among the candidates.

Legality belongs to the target (`check_region`, with a reason); the cost models are separate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import networkx as nx

from ..ir.errors import StitchflowError
from ..ir.graph import Graph, Region
from .regions import by_layer, by_origin, node_dag

EXHAUSTIVE_MAX_NODES = 12  # every subset is tried up to this size (2^12 masks, cheap bit tests)
GROW_MAX_NODES = 4  # bounded growth: connected sets of up to this many nodes around each node
SEGMENT_MAX_NODES = 16  # bounded growth: contiguous slices of a topological order up to this long


@dataclass(frozen=True)
class Refusal:
    nodes: tuple[str, ...]
    reason: str

    def __str__(self) -> str:
        return f"{{{', '.join(self.nodes)}}}: {self.reason}"


@dataclass(frozen=True)
class CandidateSet:
    """Legal candidate regions (node names in graph order) and the refused ones with reasons."""

    legal: tuple[tuple[str, ...], ...]
    refused: tuple[Refusal, ...]
    exhaustive: bool
    note: str = ""

    def __str__(self) -> str:
        kind = "all connected convex sets" if self.exhaustive else "bounded growth"
        return f"{len(self.legal)} legal candidates, {len(self.refused)} refused ({kind})"


class Legality:
    """A target's verdict on regions, cached. `target` is a name or any object with
    `check_region(graph, region) -> str | None`. A target that cannot be loaded (the dataflow
    target before it exists) is recorded in `note` and judged by the reference target."""

    def __init__(self, target="reference"):
        self.note = ""
        if isinstance(target, str):
            from ..targets import get_target

            self.name = target
            try:
                self.target = get_target(target)
            except StitchflowError as err:
                self.target = get_target("reference")
                self.note = f"target {target!r} is not available ({err}); legality from the reference target"
        else:
            self.name = getattr(target, "name", type(target).__name__)
            self.target = target
        self._cache: dict = {}

    def check(self, graph: Graph, nodes: Sequence[str]) -> str | None:
        key = (id(graph), tuple(nodes))
        if key not in self._cache:
            try:
                self._cache[key] = self.target.check_region(graph, Region("candidate", tuple(nodes)))
            except StitchflowError as err:  # a target that raises instead of answering: a refusal
                self._cache[key] = f"{type(err).__name__}: {err}"
        return self._cache[key]


class Masks:
    """Bit masks of a graph's nodes: index k is the k-th node in graph order."""

    def __init__(self, graph: Graph):
        self.names = [n.name for n in graph.nodes]
        self.index = {name: k for k, name in enumerate(self.names)}
        dag = node_dag(graph)
        self.dag = dag
        self.adjacent = [self._mask(nx.all_neighbors(dag, n)) for n in self.names]
        self.down = [self._mask(nx.descendants(dag, n)) for n in self.names]
        self.up = [self._mask(nx.ancestors(dag, n)) for n in self.names]

    def _mask(self, names: Iterable[str]) -> int:
        m = 0
        for n in names:
            m |= 1 << self.index[n]
        return m

    def of(self, names: Iterable[str]) -> int:
        return self._mask(names)

    def members(self, mask: int) -> tuple[str, ...]:
        return tuple(self.names[k] for k in range(len(self.names)) if mask >> k & 1)

    def _union(self, table: list[int], mask: int) -> int:
        # visit the set bits only: a slice late in a large graph (GPT-3: 336 nodes) is a few
        # high bits, and shifting through every bit below them dominated the planner's DP
        out = 0
        while mask:
            low = mask & -mask
            out |= table[low.bit_length() - 1]
            mask ^= low
        return out

    def convex(self, mask: int) -> bool:
        outside = ~mask
        return not (self._union(self.down, mask) & self._union(self.up, mask) & outside)

    def connected(self, mask: int) -> bool:
        if not mask:
            return False
        seen = mask & -mask
        frontier = seen
        while frontier:
            frontier = self._union(self.adjacent, frontier) & mask & ~seen
            seen |= frontier
        return seen == mask


def _exhaustive(masks: Masks) -> set[int]:
    return {m for m in range(1, 1 << len(masks.names)) if masks.connected(m) and masks.convex(m)}


def _grown(masks: Masks, limit: int) -> set[int]:
    """Connected sets of up to `limit` nodes containing each node (breadth-first extension)."""
    found: set[int] = set()
    layer = {1 << k for k in range(len(masks.names))}
    for _ in range(limit):
        found |= layer
        nxt = set()
        for m in layer:
            frontier = masks._union(masks.adjacent, m) & ~m
            while frontier:
                bit = frontier & -frontier
                frontier ^= bit
                nxt.add(m | bit)
        layer = nxt - found
    return {m for m in found if masks.convex(m)}


def chain_order(graph: Graph) -> list[str]:
    """A topological order that keeps producer -> consumer chains together: after a node, its
    consumers come next when they are ready (depth-first), else the earliest ready node."""
    dag = node_dag(graph)
    position = {n.name: k for k, n in enumerate(graph.nodes)}
    waiting = {n: dag.in_degree(n) for n in dag}
    ready = sorted((n for n, d in waiting.items() if d == 0), key=position.__getitem__)
    order: list[str] = []
    while ready:
        node = ready.pop(0)
        order.append(node)
        fresh = []
        for c in dag.successors(node):
            waiting[c] -= 1
            if waiting[c] == 0:
                fresh.append(c)
        ready = sorted(fresh, key=position.__getitem__) + ready
    return order


def segments(masks: Masks, order: Sequence[str], width: int) -> set[int]:
    """Connected contiguous slices of a topological order (convex by construction)."""
    out = set()
    for start in range(len(order)):
        m = 0
        for name in order[start:start + width]:
            m |= 1 << masks.index[name]
            if masks.connected(m):
                out.add(m)
    return out


def _groups(graph: Graph, masks: Masks) -> set[int]:
    """Per-op and per-layer groups, unions of consecutive layers, and the whole graph."""
    out = {masks.of(g) for g in by_origin(graph)}
    layers = [masks.of(g) for g in by_layer(graph)]
    for i in range(len(layers)):
        acc = 0
        for m in layers[i:]:
            acc |= m
            out.add(acc)
    out.add((1 << len(masks.names)) - 1)
    return {m for m in out if masks.connected(m) and masks.convex(m)}


def enumerate_candidates(graph: Graph, legality: Legality | None = None,
                         exhaustive_max: int = EXHAUSTIVE_MAX_NODES) -> CandidateSet:
    """Every connected convex set for small graphs, a bounded family for large ones; each
    judged by the target, refused ones kept with the target's reason. With no legality, the
    target is not asked (the planner asks lazily, about the regions it chooses)."""
    masks = Masks(graph)
    exhaustive = len(masks.names) <= exhaustive_max
    if exhaustive:
        found = _exhaustive(masks)
    else:
        found = _grown(masks, GROW_MAX_NODES) | _groups(graph, masks)
        for order in ([n.name for n in graph.nodes], chain_order(graph)):
            found |= segments(masks, order, SEGMENT_MAX_NODES)
    legal, refused = [], []
    for m in sorted(found, key=lambda m: (bin(m).count("1"), m)):
        nodes = masks.members(m)
        why = legality.check(graph, nodes) if legality else None
        (refused.append(Refusal(nodes, why)) if why else legal.append(nodes))
    return CandidateSet(tuple(legal), tuple(refused), exhaustive, legality.note if legality else "")


def is_convex_connected(graph: Graph, nodes: Sequence[str], masks: Masks | None = None) -> str | None:
    """None when `nodes` can be one region as far as the graph goes, else why not."""
    masks = masks or Masks(graph)
    m = masks.of(nodes)
    if not masks.connected(m):
        return "not connected: no producer -> consumer path links all of its nodes"
    if not masks.convex(m):
        outside = masks._union(masks.down, m) & masks._union(masks.up, m) & ~m
        return f"not convex: a path leaves it and comes back through {', '.join(masks.members(outside))}"
    return None
