"""Fusion granularities that exploration sweeps: unfused, per layer, full, the planner's candidate
plans (exploration's "auto" is the fastest of them), and FuseFlow's
GCN ablations (spec/workloads.md): only layer 1 fused, only layer 2 fused, and two sub-regions
across the layer boundary — "linear1 + bias + relu + the second adjacency product" and
"relu + adjacency + linear2 + softmax"; and FuseFlow's "fully fused" GPT-3, whose last region of
each decoder also takes the next decoder's LN+QKV.

FuseFlow's GCN associates each layer as (A·X)·W; ours is A·(X·W) (apps/gnn.py). The ablations
are named by role (linear = product with a weight, adjacency = product with the adjacency
input, bias, activation) and closed to their convex hull, so a region that names ops which are
not adjacent in our association also takes the ops on the paths between them; the name of the
configuration lists what the hull added.
"""

from __future__ import annotations

from typing import Callable

from ..ir.errors import StitchflowError
from ..ir.graph import Graph
from .auto import standard_partitions
from .candidates import Masks
from .regions import by_layer, by_origin, check_partition


def _role(graph: Graph, names: list[str]) -> str:
    reads = {t for n in names for t in graph.node_of[n].inputs}
    if graph.inputs and graph.inputs[0] in reads:
        return "adjacency"
    if any(t in graph.params and "weight" in t for t in reads):
        return "linear"
    if any(t in graph.params and "bias" in t for t in reads):
        return "bias"
    return "activation"


def roles(graph: Graph) -> dict[tuple[str, str], list[str]]:
    """(layer, role) -> node names, for GNN layers named layer1, layer2, ..."""
    out: dict[tuple[str, str], list[str]] = {}
    for group in by_origin(graph):
        layer = graph.node_of[group[0]].group or "top"
        out.setdefault((layer, _role(graph, group)), []).extend(group)
    return out


def hull(graph: Graph, names) -> list[str]:
    """The smallest convex set containing `names`: add every node on a path between two."""
    masks = Masks(graph)
    m = masks.of(names)
    inside = m | (masks._union(masks.down, m) & masks._union(masks.up, m))
    return list(masks.members(inside))


def with_rest(graph: Graph, region: list[str]) -> list[list[str]]:
    """One region plus every other node in its per-op group (pieces of a split op stay apart)."""
    taken = set(region)
    return [region] + [[n for n in g if n not in taken] for g in by_origin(graph) if not set(g) <= taken]


def gcn_ablations(graph: Graph) -> list[tuple[str, list[list[str]]]]:
    r = roles(graph)

    def pick(*keys):
        return [n for k in keys for n in r.get(k, [])]

    specs = [
        ("layer1 only", pick(*((("layer1", x) for x in ("linear", "adjacency", "bias", "activation")))), ),
        ("layer2 only", pick(*((("layer2", x) for x in ("linear", "adjacency", "bias", "activation")))), ),
        ("lin1+bias+relu+adj2", pick(("layer1", "linear"), ("layer1", "bias"), ("layer1", "activation"),
                                     ("layer2", "adjacency"))),
        ("relu+adj2+lin2+softmax", pick(("layer1", "activation"), ("layer2", "adjacency"), ("layer2", "linear"),
                                        ("layer2", "activation"))),
    ]
    out = []
    for name, names in specs:
        closed = hull(graph, names)
        added = sorted({graph.node_of[n].origin for n in closed} - {graph.node_of[n].origin for n in names})
        out.append((name + (f" (hull +{'+'.join(added)})" if added else ""), with_rest(graph, closed)))
    return out


def gpt3_fuseflow_full(graph: Graph) -> list[tuple[str, list[list[str]]]]:
    """FuseFlow's "fully fused" GPT-3 (spec/workloads.md): per layer's three regions of each
    decoder (LN+QKV, attention, out-projection+residual+LN+FFN+residual), with the next decoder's
    LN+QKV fused into each decoder's last region. Per-layer groups are named `decoders.<d>.qkv`,
    `.attn` and `.mlp` (GPT3.partial_depth = 2)."""
    groups = by_layer(graph)
    layer = [graph.node_of[g[0]].group or "" for g in groups]
    merged, k = [], 0
    while k < len(groups):
        if layer[k].endswith(".mlp") and k + 1 < len(groups) and layer[k + 1].endswith(".qkv"):
            merged.append(groups[k] + groups[k + 1])
            k += 2
        else:
            merged.append(groups[k])
            k += 1
    return [("full, FuseFlow's (+ next LN+QKV)", merged)] if len(merged) < len(groups) else []


def partition_key(groups) -> frozenset:
    return frozenset(frozenset(g) for g in groups)


def granularities(app: str, graph: Graph, auto: Callable[[], list[tuple[str, list[list[str]]]]]):
    """[(name, groups)] for the app, and notes on any that were skipped (with the reason).
    `auto()` gives the planner's candidate plans [(label, groups)], named "ilp <label>"; one
    that is the same partition as a fixed granularity is not listed twice (a note says so)."""
    grans = standard_partitions(graph)
    if app == "gcn":
        grans += gcn_ablations(graph)
    if app == "gpt3-bigbird":
        grans += gpt3_fuseflow_full(graph)
    grans += [(f"ilp {label}", groups) for label, groups in auto()]
    kept, notes, seen = [], [], {}
    for name, groups in grans:
        try:
            check_partition(graph, groups)
        except StitchflowError as err:
            notes.append(f"granularity {name} skipped: {err}")
            continue
        key = partition_key(groups)
        if key in seen:
            notes.append(f"granularity {name} is the same partition as {seen[key]}")
            if name.startswith("ilp "):
                continue
        seen.setdefault(key, name)
        kept.append((name, groups))
    return kept, notes
