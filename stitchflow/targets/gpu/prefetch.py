"""A program's kernels compiled ahead of its first call, all at once.

A cold first call used to compile kernel by kernel: each generated kernel waited for its own
autotuning space (the slowest config, up to the compile deadline) before the next one's compiles
began, so a ResNet's training step used about 5 of a 16-core host's threads. Before the first call
runs, `prefetch` walks the program's steps on meta tensors (shapes, strides and dtypes, no data):
each generated kernel works out the signature its call will see and queues the compiles that call
will want (compiles.submit), and puts meta outputs where its launch would put real ones; torch
steps run on the meta tensors to give their outputs' strides. The real call then finds its
kernels compiled or compiling (the tuner promotes those still queued).

A step that cannot run on meta tensors (a library kernel with its own tuning, an op without a
meta implementation) writes nothing: whoever reads its outputs sees contiguous tensors of their
IR types, the common case. A wrong guess costs a compile that is never used, never a wrong
result: every launch is still built for the tensors of the real call.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from ...ir.graph import Graph
from .runtime import GroupKernel, interpreting

log = logging.getLogger("stitchflow.gpu")


class MetaEnv(dict):
    """Names to meta tensors; a name nothing has written reads as a contiguous tensor of its IR type."""

    def __init__(self, graph: Graph, values: dict):
        super().__init__({name: meta_like(v) for name, v in values.items()})
        self.graph = graph

    def __missing__(self, name: str) -> torch.Tensor:
        ty = self.graph.type_of[name]  # a KeyError for names the graph does not know, as a dict's
        value = self[name] = torch.empty(ty.shape, dtype=ty.dtype, device="meta")
        return value


def meta_like(value):
    """A dense tensor as a meta tensor of its shape, strides, dtype and offset; anything else as it is."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return value
    base = torch.empty(value.untyped_storage().nbytes() // value.element_size() + 1, dtype=value.dtype, device="meta")
    return base.as_strided(value.shape, value.stride(), value.storage_offset())


def prefetch(graph: Graph, runs, env: dict) -> int:
    """Queue the compiles of every generated kernel of `runs` (a program's compiled regions) for a call on
    `env`; returns the compiles queued. Only on a CUDA device (the interpreter compiles nothing);
    options={"prefetch": False} or STITCHFLOW_PREFETCH=0 turn it off."""
    device = next((v.device for v in env.values() if isinstance(v, torch.Tensor) and v.is_cuda), None)
    if device is None or interpreting() or os.environ.get("STITCHFLOW_PREFETCH") == "0":
        return 0
    started = time.perf_counter()
    queued, kernels = walk(graph, runs, env, device)
    log.info("stitchflow: %d compiles of %d kernels queued ahead of the first call (%.2f s)", queued, kernels,
             time.perf_counter() - started)
    return queued


def walk(graph: Graph, runs, env: dict, device: torch.device) -> tuple[int, int]:
    """The steps of `runs` on meta tensors standing for `env`'s on `device`: (compiles queued, kernels seen)."""
    meta, queued, kernels = MetaEnv(graph, env), 0, 0
    for run in runs:
        for step in getattr(run, "steps", ()):
            try:
                if isinstance(step, GroupKernel):
                    queued += step.prefetch(meta, device)
                    kernels += 1
                elif hasattr(step, "on_meta"):  # torch's ops and convolutions
                    step.on_meta(meta)
            except Exception as err:  # noqa: BLE001 (a guess that fails costs a later compile, nothing else)
                log.debug("prefetch: %s: %s: %s", step, type(err).__name__, err)
    return queued, kernels
