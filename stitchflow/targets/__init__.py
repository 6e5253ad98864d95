"""Targets run regions. This module is only the registry: targets never import each other.

A target provides `check_region(graph, region) -> str | None` (None when it can run the
region, else the reason) and `compile_region(graph, region, params, options, examples=None) -> callable(env)`,
where the callable reads the region's inputs from `env` (a dict of tensor name -> torch
tensor; graph inputs, parameters and outputs of earlier regions) and writes every node output
of the region that a later region or the program's outputs read back into it. `params` holds
the constant tensors; `options` the target-specific knobs the user passed to compile(); `examples`
the example inputs by name, which a target may read for its static estimates but must not keep.
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

    def compile_region(self, graph: Graph, region: Region, params: dict, options: dict, examples=None): ...


def get_target(name: str) -> Target:
    module = TARGETS.get(name)
    if module is None:
        raise StitchflowError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}")
    try:
        return importlib.import_module(module).TARGET
    except (ImportError, AttributeError) as err:
        raise StitchflowError(f"target {name!r} is not available: {err}") from err
