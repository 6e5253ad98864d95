"""Readable reports: the regions of a program, and for every producer -> consumer pair of
nodes whether they share a region and why."""

from __future__ import annotations

from ..ir.graph import Graph, Region


def fusion_reason(graph: Graph, fusion, a: str, b: str, same: bool) -> str:
    na, nb = graph.node_of[a], graph.node_of[b]
    if same:
        if na.origin == nb.origin:
            return "parts of one torch op" + (f" ({na.tag.kind})" if na.tag else "")
        if fusion == "partial":
            return f"same layer ({na.group or 'top level'})"
        if fusion == "full":
            return "full fusion: one region"
        if fusion == "auto":
            return f"{a} is used only by {nb.origin}: fused into its consumer"
        return "listed in one region"
    if fusion == "unfused":
        return "unfused: each torch op is its own region"
    if fusion == "partial":
        return f"different layers ({na.group or 'top level'} -> {nb.group or 'top level'})"
    if fusion == "auto":
        users = graph.consumers.get(a, ())
        if a in graph.outputs:
            return f"{a} is a program output and must be written"
        if len({graph.node_of[u].origin for u in users}) > 1:
            return f"{a} has {len(users)} consumers in different ops: fusing one would recompute or re-read it"
        return "fusing would close a cycle between regions"
    return "listed in different regions"


def explain_regions(graph: Graph, regions: tuple[Region, ...], fusion, target: str) -> str:
    owner = {n: r.name for r in regions for n in r.nodes}
    lines = [f"stitchflow program: target={target}, fusion={fusion}, {len(graph.nodes)} nodes, {len(regions)} regions"]
    lines.append("inputs: " + ", ".join(f"{n}: {graph.type_of[n]}" for n in graph.inputs))
    sparse = [n for n in graph.params if graph.type_of[n].format.is_sparse]
    if sparse:
        lines.append("sparse parameters: " + ", ".join(f"{n}: {graph.type_of[n]}" for n in sparse))
    lines.append("")
    lines.append("regions:")
    for r in regions:
        lines.append(f"  {r.name} ({len(r.nodes)} nodes)")
        lines += [f"    {graph.node_of[n]}" for n in r.nodes]
    lines += ["", "producer -> consumer:"]
    for n in graph.nodes:
        for p in graph.producers(n):
            same = owner[p] == owner[n.name]
            verdict = "fused" if same else "not fused"
            lines.append(f"  {p} -> {n.name}: {verdict} ({owner[p]}{'' if same else ' -> ' + owner[n.name]}): "
                         f"{fusion_reason(graph, fusion, p, n.name, same)}")
    return "\n".join(lines)


def explain_program(prog) -> str:
    return explain_regions(prog.graph, prog.regions, prog.fusion, prog.target_name)
