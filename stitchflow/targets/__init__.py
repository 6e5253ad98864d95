"""Targets run regions. This module is only the registry: targets never import each other.

A target provides `check_region(graph, region) -> str | None` (None when it can run the
region, else the reason) and `compile_region(graph, region, params) -> callable(env)`, where
the callable reads the region's inputs from `env` and writes the outputs the rest of the
program needs back into it.
"""

from __future__ import annotations

import importlib
from typing import Protocol

from ..ir.errors import StitchflowError
from ..ir.graph import Graph, Region

TARGETS = {
    "reference": "stitchflow.targets.reference",
    "dataflow": "stitchflow.targets.dataflow",
    "gpu": "stitchflow.targets.gpu",
}


class Target(Protocol):
    name: str

    def check_region(self, graph: Graph, region: Region) -> str | None: ...

    def compile_region(self, graph: Graph, region: Region, params: dict): ...


def get_target(name: str) -> Target:
    module = TARGETS.get(name)
    if module is None:
        raise StitchflowError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}")
    try:
        return importlib.import_module(module).TARGET
    except (ImportError, AttributeError) as err:
        raise StitchflowError(f"target {name!r} is not available: {err}") from err
