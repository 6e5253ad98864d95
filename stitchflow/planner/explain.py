"""Readable reports: the regions of a program, and for every producer -> consumer pair of
nodes whether they share a region and why — the configuration that put them there, the
target's legality verdict, or the cost comparison that decided (traffic saved against FLOPs
recomputed, from the target's static cost model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ..ir.graph import Graph, Region
from .candidates import Legality, is_convex_connected
from .cost import is_contraction, model_for, stored_bytes
from .ilp import Costs, _quotient_cycle
from .stats import measure


@dataclass(frozen=True)
class PairVerdict:
    producer: str
    consumer: str
    fused: bool
    reason: str

    def __str__(self) -> str:
        return f"{self.producer} -> {self.consumer}: {'fused' if self.fused else 'not fused'}: {self.reason}"


def fusion_reason(graph: Graph, fusion, a: str, b: str, same: bool) -> str:
    """What the fusion configuration says about the pair a -> b (no cost model involved)."""
    na, nb = graph.node_of[a], graph.node_of[b]
    if same:
        if na.origin == nb.origin:
            return "parts of one torch op" + (f" ({na.tag.kind})" if na.tag else "")
        return {"partial": f"same layer ({na.group or 'top level'})", "full": "full fusion: one region",
                "auto": "the integer program chose one region"}.get(fusion, "listed in one region") \
            if isinstance(fusion, str) else "listed in one region"
    if fusion == "unfused":
        return "unfused: each torch op is its own region"
    if fusion == "partial":
        return f"different layers ({na.group or 'top level'} -> {nb.group or 'top level'})"
    if fusion == "auto":
        return "the integer program chose separate regions"
    return "listed in different regions"


class _Judge:
    """Prices a region and the merge of two regions with one model and one legality oracle."""

    def __init__(self, graph: Graph, regions: Sequence[Region], target, values):
        self.graph = graph
        self.legality = Legality(target)
        self.model = model_for(self.legality.name, measure(graph, values))
        self.costs = Costs(graph, self.model)
        self.groups = [list(r.nodes) for r in regions]
        self.owner = {n: g for g, r in enumerate(regions) for n in r.nodes}

    def node_flops(self, name: str) -> float:
        return self.costs.estimate([name]).flops

    def fused(self, p: str, c: str) -> str:
        region = self.groups[self.owner[p]]
        leaves = p in self.graph.outputs or any(u not in region for u in self.graph.consumers.get(p, ()))
        saved = stored_bytes(self.graph, p, 1.0) * (1 if leaves else 2)
        loop = self.costs.estimate(region).loop
        if loop is None:  # a dense region with GEMMs, estimated step by step as the gpu target runs it
            gemm = next((n for n in (p, c) if is_contraction(self.graph.node_of[n])), None)
            if gemm is not None:
                return f"one region, two steps: {p} is stored for {c} ({gemm} runs as a library GEMM)"
            return f"fused: saves {saved:.4g} bytes of traffic"
        extra = self.node_flops(p) * max(0.0, loop.nest_of(p).factor - 1.0)
        return f"fused: saves {saved:.4g} bytes of traffic, costs {extra:.4g} recomputed FLOPs"

    def apart(self, p: str, c: str) -> str:
        a, b = self.owner[p], self.owner[c]
        merged = self.groups[a] + self.groups[b]
        order = {n.name: k for k, n in enumerate(self.graph.nodes)}
        merged = sorted(merged, key=order.__getitem__)
        shape = is_convex_connected(self.graph, merged)
        if shape:
            return f"fusing their regions would be {shape}"
        trial = [g for k, g in enumerate(self.groups) if k not in (a, b)] + [merged]
        if _quotient_cycle(self.graph, trial):
            return "fusing their regions would close a cycle between regions"
        why = self.legality.check(self.graph, tuple(merged))
        if why:
            return f"target {self.legality.name} refuses the fused region: {why}"
        return self._compare(p, merged, self.groups[a], self.groups[b])

    def _compare(self, p: str, merged, ra, rb) -> str:
        unit = getattr(self.model, "unit", "cost")
        together = self.costs.of(merged)
        separate = self.costs.of(ra) + self.costs.of(rb)
        est = self.costs.estimate(merged)
        nests = est.loop.nests if est.loop is not None else ()  # None: step by step, nothing recomputed
        worst = max(nests, key=lambda n: self.node_flops(n.node) * (n.factor - 1.0), default=None)
        recompute = ""
        if worst is not None and worst.factor > 1.0:
            extra = self.node_flops(worst.node) * (worst.factor - 1.0)
            recompute = (f"would recompute {worst.node} {worst.factor:.3g} times over "
                         f"{', '.join(worst.recompute_vars)} (+{extra:.3g} FLOPs); ")
        if together > separate:
            return f"not fused: {recompute}fused {together:.4g} {unit} > apart {separate:.4g} {unit}"
        return f"fusing would save {separate - together:.4g} {unit} ({recompute or 'no recomputation'})"


def pair_verdicts(graph: Graph, regions: Sequence[Region], fusion, target="reference",
                  values: Mapping | None = None) -> tuple[PairVerdict, ...]:
    """A verdict with a reason for every producer -> consumer pair of nodes."""
    judge = _Judge(graph, regions, target, values)
    out = []
    for n in graph.nodes:
        for p in dict.fromkeys(graph.producers(n)):
            same = judge.owner[p] == judge.owner[n.name]
            base = fusion_reason(graph, fusion, p, n.name, same)
            detail = judge.fused(p, n.name) if same else judge.apart(p, n.name)
            out.append(PairVerdict(p, n.name, same, f"{base}; {detail}"))
    return tuple(out)


def explain_regions(graph: Graph, regions: tuple[Region, ...], fusion, target: str,
                    values: Mapping | None = None) -> str:
    owner = {n: r.name for r in regions for n in r.nodes}
    lines = [f"stitchflow program: target={target}, fusion={fusion}, {len(graph.nodes)} nodes, {len(regions)} regions"]
    lines.append("inputs: " + ", ".join(f"{n}: {graph.type_of[n]}" for n in graph.inputs))
    sparse = [n for n in graph.params if graph.type_of[n].format.is_sparse]
    if sparse:
        lines.append("sparse parameters: " + ", ".join(f"{n}: {graph.type_of[n]}" for n in sparse))
    lines += ["", "regions:"]
    for r in regions:
        lines.append(f"  {r.name} ({len(r.nodes)} nodes)")
        lines += [f"    {graph.node_of[n]}" for n in r.nodes]
    lines += ["", "producer -> consumer:"]
    for v in pair_verdicts(graph, regions, fusion, target, values):
        where = owner[v.producer] if v.fused else f"{owner[v.producer]} -> {owner[v.consumer]}"
        lines.append(f"  {v.producer} -> {v.consumer}: {'fused' if v.fused else 'not fused'} ({where}): {v.reason}")
    return "\n".join(lines)


def explain_program(prog) -> str:
    # the values the plan was made with (inputs too) when the program keeps them, else parameters
    values = getattr(prog, "plan_values", None) or getattr(prog.captured, "param_values", None)
    text = explain_regions(prog.graph, prog.regions, prog.fusion, prog.target_name, values)
    notes = getattr(prog.captured, "notes", None)  # what capture and the target's rewrites of the graph did
    if notes:
        text = "\n".join([text, "", "graph rewrites:", *(f"  {note}" for note in notes)])
    inputs = _program_inputs(prog.captured)
    if inputs:
        text = "\n".join([text, "", "inputs the program supplies or holds:", *(f"  {line}" for line in inputs)])
    target_lines = getattr(prog.target, "explain", None)  # what the target itself decides (gpu: chain plans)
    if target_lines is not None:
        params = getattr(prog.captured, "param_values", None)
        text = "\n".join([text] + target_lines(prog.graph, prog.regions, prog.options, params=params))
    return text


def _program_inputs(captured) -> list[str]:
    """The random ops' seed (drawn at every call) and the inputs read as numbers (constants of the program)."""
    lines = []
    seed = getattr(captured, "random_seed", None)
    if seed is not None:
        lines.append(f"{seed}: drawn from torch's generator at every call (the random ops' Philox key)")
    for k, number in getattr(captured, "valued_inputs", ()):
        lines.append(f"{captured.input_names[k]}: read as the number {number}; another number needs another program")
    return lines
