"""Probe: how long the automatic plans of an app's training step take, made fresh and read back from the plan
cache (planner/plan_cache.py). The step runs once on the CPU through torch.compile(backend="stitchflow") with
the gpu target, recording every partition's graph instead of compiling it; then each graph is planned as the
backend would, fresh (an empty cache), from disk (a new process's view), and from the in-memory memo. Not a test.

    python scripts/planning_time_probe.py [--app resnet] [--size small] [--busy N]

--busy N keeps N other processes spinning while the plans are made (a cold start's compile workers keep every
core busy). On an H100 host (16 cores), ResNet-18 at the default size: 9.8 s fresh alone, 10.8 s beside 16
spinning processes; HiGHS on one thread instead of its default changed neither (10.1, 11.9 s).
"""
import argparse
import multiprocessing
import os
import tempfile
import time

import torch

import stitchflow.backend as backend
from stitchflow.bench.training import _runner, _step, training_case
from stitchflow.ir.errors import StitchflowError
from stitchflow.planner import auto

GRAPHS = []


def _record(graph, fusion, target="reference", values=None):
    GRAPHS.append(graph)
    raise StitchflowError("recorded, not compiled")  # the partition runs eagerly


def _spin(parent: int) -> int:
    """Keep a core busy (a compile worker's load) until terminated, or orphaned (a parent killed by `timeout`
    does not stop its daemon children, and sixteen left spinning once slowed a later benchmark's runners)."""
    turns = 0
    while turns % (1 << 20) or os.getppid() == parent:
        turns += 1
    return turns


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--app", default="resnet")
    p.add_argument("--size", default="small")
    p.add_argument("--busy", type=int, default=0)
    args = p.parse_args()
    os.environ["STITCHFLOW_CACHE"] = tempfile.mkdtemp()  # an empty cache: "fresh" plans everything
    os.environ["STITCHFLOW_PLAN_CACHE"] = "1"
    backend.regions_for = _record
    model, inputs, upstream = training_case(args.app, torch.float32, args.size, device="cpu")
    _step(_runner("backend=stitchflow", model, {"target": "gpu"}), model, inputs, upstream)
    print(f"{args.app} ({args.size}): {len(GRAPHS)} graphs of {[len(g.nodes) for g in GRAPHS]} nodes, "
          f"{args.busy} busy processes", flush=True)
    spinning = [multiprocessing.Process(target=_spin, args=(os.getpid(),), daemon=True) for _ in range(args.busy)]
    for proc in spinning:
        proc.start()
    for label in ("fresh", "from disk", "memo"):
        if label == "from disk":
            auto._PLANS.clear()
        start = time.perf_counter()
        plans = [auto.auto_plan(g, "gpu") for g in GRAPHS]
        regions = sum(len(p.regions) for p in plans)
        print(f"  {label}: {time.perf_counter() - start:.2f} s, {regions} regions", flush=True)
    for proc in spinning:
        proc.terminate()


if __name__ == "__main__":
    main()
