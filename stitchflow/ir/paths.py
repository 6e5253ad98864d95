"""Where stitchflow keeps files between processes: `$STITCHFLOW_CACHE`, default ~/.cache/stitchflow.

    plans/          the planner's automatic plans (planner/plan_cache.py)
    gpu/kernels/    generated kernel sources (targets/gpu/runtime.py), beside the chosen configs
    gpu/chains.json the chain plans' timed winners per shape bucket (targets/gpu/chains.py)
    gpu/cuda/       CUDA C++ modules (targets/gpu/cluster_planes.py)

Compiled binaries live in Triton's own cache (`TRITON_CACHE_DIR`). `stitchflow cache` lists and clears these.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("STITCHFLOW_CACHE") or Path.home() / ".cache" / "stitchflow")
