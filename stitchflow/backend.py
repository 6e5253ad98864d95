"""The `torch.compile(model, backend="stitchflow")` backend.

Dynamo hands us an FX graph. Runs of nodes with a lowering are split into partitions (torch.fx's
split_module); each partition becomes a submodule that, on its first call,
captures itself on the real arguments and runs through a stitchflow Program from then on.
Everything else runs eagerly, and every fallback is recorded with its reason: set
STITCHFLOW_LOGS=1 (or configure the "stitchflow" logger) to see them as they happen, or call
`stitchflow.backend.fallback_report()`.

Options (torch.compile(..., options={...})): target ("reference" | "gpu"; default "gpu" for
CUDA tensors, else "reference"), fusion (default "auto").
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from .frontend.capture import capture
from .frontend.registry import LOWERINGS, describe_target, key_of
from .ir.errors import StitchflowError
from .planner.regions import regions_for
from .program import Program

log = logging.getLogger("stitchflow.backend")
if os.environ.get("STITCHFLOW_LOGS"):
    logging.basicConfig()
    logging.getLogger("stitchflow").setLevel(logging.DEBUG if os.environ["STITCHFLOW_LOGS"] == "debug" else logging.INFO)

FALLBACKS: list[str] = []  # every reason a piece of a model ran eagerly, in order


def _record(reason: str) -> None:
    FALLBACKS.append(reason)
    log.info("stitchflow: runs eagerly: %s", reason)


def fallback_report() -> str:
    if not FALLBACKS:
        return "stitchflow: everything captured ran through stitchflow"
    return "stitchflow fell back to eager for:\n" + "\n".join(f"  - {r}" for r in FALLBACKS)


def _supported(node: fx.Node) -> bool:
    """Has a lowering (creation ops such as torch.ones stay eager and enter as inputs)."""
    if node.op not in ("call_function", "call_method"):
        return False
    return key_of(node) in LOWERINGS



class StitchflowModule(torch.nn.Module):
    """One partition: compiled on first call for each input signature, eager if capture fails."""

    def __init__(self, gm: fx.GraphModule, target: str | None, fusion, name: str):
        super().__init__()
        self.gm, self.target, self.fusion, self.name = gm, target, fusion, name
        self.programs: dict[tuple, Program | None] = {}

    def forward(self, *args):
        key = tuple((tuple(a.shape), a.dtype, a.layout, a.device.type) if isinstance(a, torch.Tensor) else a
                    for a in args)
        if key not in self.programs:
            self.programs[key] = self._compile(args)
        prog = self.programs[key]
        return prog(*args) if prog is not None else self.gm(*args)

    def _compile(self, args) -> Program | None:
        target = self.target or ("gpu" if any(isinstance(a, torch.Tensor) and a.is_cuda for a in args) else "reference")
        try:
            captured = capture(self.gm, args)
            prog = Program(captured, regions_for(captured.graph, self.fusion, target=target), target, self.fusion)
            log.info("stitchflow: %s compiled for %s: %d nodes in %d regions", self.name, target,
                     len(captured.graph.nodes), len(prog.regions))
            return prog
        except StitchflowError as err:
            _record(f"{self.name}: {err}")
            return None

    @property
    def regions_executed(self) -> int:
        return sum(p.regions_executed for p in self.programs.values() if p is not None)


def stitchflow_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict | None = None, **kwargs):
    """Dynamo backend entry point (registered as "stitchflow" through torch_dynamo_backends).
    It never breaks the model: if partitioning itself fails, the whole graph runs eagerly."""
    options = dict(options or {}) | kwargs
    try:
        return _partition_and_wrap(gm, options)
    except Exception as err:  # a bug or an FX corner case must cost speed, never the user's run
        _record(f"whole graph ({len(gm.graph.nodes)} nodes): {type(err).__name__}: {err}")
        return gm.forward


def _partition_ids(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Maximal runs of consecutive supported nodes share a partition; every unsupported node
    is a partition of its own. Runs in program order can never depend on each other cyclically."""
    ids, current, supported_run = {}, 0, False
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        ok = _supported(node) or node.op == "get_attr"
        if not (ok and supported_run):
            current += 1
        ids[node] = current
        supported_run = ok
    return ids


def _partition_and_wrap(gm: fx.GraphModule, options: dict):
    target, fusion = options.get("target"), options.get("fusion", "auto")
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method") and not _supported(node):
            _record(f"{describe_target(node)} ({node.name}): no lowering to the IR")
        elif node.op == "call_module":
            _record(f"module {node.target} ({node.name}): leaf modules are not captured")
    ids = _partition_ids(gm)
    supported_ids = {ids[n] for n in ids if _supported(n)}
    split = split_module(gm, gm, lambda node: ids[node], keep_original_order=True)
    compiled = []
    for node in list(split.graph.nodes):
        if node.op == "call_module" and int(node.target.removeprefix("submod_")) in supported_ids:
            module = StitchflowModule(split.get_submodule(node.target), target, fusion, node.target)
            setattr(split, node.target, module)
            compiled.append(module)
    split.recompile()
    split.stitchflow_modules = compiled
    COMPILED.extend(compiled)
    return split


COMPILED: list[StitchflowModule] = []  # every partition compiled since the last reset()


def regions_executed() -> int:
    """Regions run through stitchflow programs by every partition compiled since reset()."""
    return sum(m.regions_executed for m in COMPILED)


def reset() -> None:
    COMPILED.clear()
    FALLBACKS.clear()
