"""The reference target: every region runs through the IR interpreter on the CPU (or wherever
the tensors live). It can run any region, and it is what other targets are checked against."""

from __future__ import annotations

from ..ir.graph import Graph, Region
from ..ir.interpret import run_graph


class ReferenceTarget:
    name = "reference"

    def check_region(self, graph: Graph, region: Region) -> str | None:
        return None

    def compile_region(self, graph: Graph, region: Region, params: dict, options: dict, examples=None):
        nodes = [graph.node_of[n] for n in region.nodes]

        def run(env):
            run_graph(graph, env, nodes)

        return run


TARGET = ReferenceTarget()
