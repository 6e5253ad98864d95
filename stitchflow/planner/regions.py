"""Fusion configurations -> regions, and the legality of a partition (convex, covering).

A fusion configuration names which IR nodes share a region: "unfused" (one region per torch
op), "partial" (one per top-level submodule call, i.e. per layer), "full" (one region), or an
explicit list of regions given by node names, torch-op (FX node) names or submodule names.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import networkx as nx

from ..ir.errors import StitchflowError
from ..ir.graph import Graph, Region

CONFIGS = ("unfused", "partial", "full", "auto")


def node_dag(graph: Graph) -> nx.DiGraph:
    dag = nx.DiGraph()
    dag.add_nodes_from(n.name for n in graph.nodes)
    for n in graph.nodes:
        for p in graph.producers(n):
            dag.add_edge(p, n.name)
    return dag


def check_partition(graph: Graph, groups: Sequence[Sequence[str]]) -> None:
    """Every node in exactly one group, and no cycle between groups (each group convex)."""
    seen: dict[str, int] = {}
    for g, names in enumerate(groups):
        for name in names:
            if name not in graph.node_of:
                raise StitchflowError(f"region {g} names {name!r}, which is not a node of the graph")
            if name in seen:
                raise StitchflowError(f"node {name!r} is in regions {seen[name]} and {g}")
            seen[name] = g
    missing = [n.name for n in graph.nodes if n.name not in seen]
    if missing:
        raise StitchflowError(f"nodes {missing} are in no region")
    quotient = region_graph(graph, seen, len(groups))
    if not nx.is_directed_acyclic_graph(quotient):
        cycle = nx.find_cycle(quotient)
        raise StitchflowError(f"regions {sorted({a for a, _ in cycle})} depend on each other in a cycle")


def region_graph(graph: Graph, owner: dict[str, int], n_groups: int) -> nx.DiGraph:
    """The graph of regions: an edge where a node of one region reads a node of another."""
    quotient = nx.DiGraph()
    quotient.add_nodes_from(range(n_groups))
    for n in graph.nodes:
        for p in graph.producers(n):
            if owner[p] != owner[n.name]:
                quotient.add_edge(owner[p], owner[n.name])
    return quotient


def ordered_regions(graph: Graph, groups: Sequence[Sequence[str]], prefix: str = "r") -> tuple[Region, ...]:
    """Regions in a topological order of the region graph, their nodes in graph order."""
    check_partition(graph, groups)
    position = {n.name: k for k, n in enumerate(graph.nodes)}
    owner = {name: g for g, names in enumerate(groups) for name in names}
    quotient = region_graph(graph, owner, len(groups))
    order = nx.lexicographical_topological_sort(quotient, key=lambda g: min(position[x] for x in groups[g]))
    return tuple(
        Region(f"{prefix}{k}", tuple(sorted(groups[g], key=position.__getitem__))) for k, g in enumerate(order) if groups[g]
    )


def by_origin(graph: Graph) -> list[list[str]]:
    groups: dict[str, list[str]] = {}
    for n in graph.nodes:
        groups.setdefault(n.origin or n.name, []).append(n.name)
    return list(groups.values())


def by_layer(graph: Graph) -> list[list[str]]:
    """One group per top-level submodule; top-level ops join the group of a producer (the layer
    they finish, e.g. a final softmax), else form a group of their own."""
    owner: dict[str, str] = {}
    for n in graph.nodes:
        if n.group:
            owner[n.name] = n.group
            continue
        producers = [owner[p] for p in graph.producers(n) if p in owner]
        owner[n.name] = producers[-1] if producers else f"<top:{n.origin}>"
    groups: dict[str, list[str]] = {}
    for n in graph.nodes:
        groups.setdefault(owner[n.name], []).append(n.name)
    return _split_cycles(graph, list(groups.values()))


def _split_cycles(graph: Graph, groups: list[list[str]]) -> list[list[str]]:
    try:
        check_partition(graph, groups)
        return groups
    except StitchflowError:
        return by_origin(graph)


def explicit(graph: Graph, spec: Iterable[Iterable[str]]) -> list[list[str]]:
    """Resolve names in an explicit region list: node names, FX op names or submodule names.
    Nodes left out get a region each, so a partial list fuses just what it names."""
    by_origin_name: dict[str, list[str]] = {}
    by_group: dict[str, list[str]] = {}
    for n in graph.nodes:
        by_origin_name.setdefault(n.origin, []).append(n.name)
        by_group.setdefault(n.group, []).append(n.name)
    groups = []
    for entry in spec:
        names: list[str] = []
        for item in ([entry] if isinstance(entry, str) else entry):
            if item in graph.node_of:
                names.append(item)
            elif item in by_origin_name:
                names += by_origin_name[item]
            elif item in by_group and item:
                names += by_group[item]
            else:
                raise StitchflowError(f"region entry {item!r} names no node, op or submodule of the graph")
        groups.append(list(dict.fromkeys(names)))
    covered = {x for g in groups for x in g}
    rest = [g for g in by_origin(graph) if not covered & set(g)]
    return groups + rest


def regions_for(graph: Graph, fusion, target: str = "reference", values=None) -> tuple[Region, ...]:
    """Regions of a fusion configuration. "auto" plans with the integer program for `target`
    (its legality and static cost model), measuring densities from `values` (name -> tensor,
    e.g. the captured parameters) when given."""
    if isinstance(fusion, str):
        if fusion == "unfused":
            return ordered_regions(graph, by_origin(graph))
        if fusion == "partial":
            return ordered_regions(graph, by_layer(graph))
        if fusion == "full":
            return ordered_regions(graph, [[n.name for n in graph.nodes]])
        if fusion == "auto":
            from .auto import auto_plan

            return auto_plan(graph, target, values).regions
        raise StitchflowError(f"unknown fusion configuration {fusion!r}; use one of {CONFIGS} or a list of regions")
    return ordered_regions(graph, explicit(graph, fusion))
