"""The default automatic plan: fuse every torch op into its consumer when the op's results
are used by that consumer alone (so no intermediate is lost to fusion) and the region graph
stays acyclic. Cost-driven plans (integer program, search) refine this per target."""

from __future__ import annotations

from ..ir.errors import StitchflowError
from ..ir.graph import Graph
from .regions import by_origin, check_partition


def auto_groups(graph: Graph) -> list[list[str]]:
    groups = by_origin(graph)
    changed = True
    while changed:
        changed = False
        owner = {name: g for g, names in enumerate(groups) for name in names}
        for g, names in enumerate(groups):
            consumers = {owner[c] for n in names for c in graph.consumers.get(n, ()) if owner[c] != g}
            escapes = any(n in graph.outputs for n in names)
            if len(consumers) != 1 or escapes:
                continue
            (target,) = consumers
            merged = [x for k, grp in enumerate(groups) if k not in (g, target) for x in [grp]]
            candidate = merged + [groups[g] + groups[target]]
            try:
                check_partition(graph, candidate)
            except StitchflowError:
                continue
            groups = candidate
            changed = True
            break
    return groups
