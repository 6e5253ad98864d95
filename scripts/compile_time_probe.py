"""Device probe: where the first training step's time goes under torch.compile(backend="stitchflow"):
Triton compiles (count, summed seconds, and the wall time of the autotuner's builds, which compile on
threads), the autotuner's timing, CUDA C++ cluster modules, and everything else (Dynamo, AOTAutograd,
planning, eager steps). Run it with empty caches (STITCHFLOW_CACHE, TRITON_CACHE_DIR) to see a cold
start. Then two more steps, and eager's step for scale. Not a test.

    STITCHFLOW_CACHE=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) python scripts/compile_time_probe.py \
        [--app resnet] [--size default] [--dtype bfloat16]
"""
import argparse
import collections
import copy
import functools
import os
import shutil
import sys
import threading
import time

import torch
import triton.compiler

import stitchflow.backend as backend
import stitchflow.program as program
import stitchflow.replay as replay
import stitchflow.training as training
from stitchflow.bench.training import _runner, _step, training_case
from stitchflow.targets.gpu import cluster_planes, compiles, prefetch, runtime, timing

TOTALS: collections.Counter = collections.Counter()
LOCK = threading.Lock()


def _timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            with LOCK:
                TOTALS[name + " s"] += time.perf_counter() - start
                TOTALS[name + " calls"] += 1
    return wrapper


def _report_builds(build):
    """Each kernel build as it ends: title, seconds, configs timed."""
    @functools.wraps(build)
    def wrapper(self, env, sig):
        start = time.perf_counter()
        launch = build(self, env, sig)
        print(f"  {time.perf_counter() - start:6.2f} s  {self.title[:70]}  tuned {self.tuned_us} us "
              f"chosen {[str(c) for c in self.chosen or ()]}", flush=True)
        return launch
    return wrapper


def _report_every(seconds: float) -> None:
    """Totals so far, from a daemon thread (a step that runs for minutes shows where it is)."""
    def loop():
        start = time.perf_counter()
        while True:
            time.sleep(seconds)
            with LOCK:
                items = sorted(TOTALS.items())
            print(f"[{time.perf_counter() - start:.0f} s] " + "; ".join(
                f"{k}: {v:.1f}" if k.endswith(" s") else f"{k}: {v}" for k, v in items), flush=True)
    threading.Thread(target=loop, daemon=True).start()


def _report_slow_compiles(compile, seconds: float = 5.0):
    """Compiles that take longer than `seconds`: the generated module (its docstring names the kernel)."""
    @functools.wraps(compile)
    def wrapper(src, *args, **kwargs):
        start = time.perf_counter()
        kernel = compile(src, *args, **kwargs)
        took = time.perf_counter() - start
        if took > seconds:
            module = sys.modules.get(getattr(getattr(src, "fn", None), "__module__", ""), None)
            path = getattr(module, "__file__", "?")
            title = (module.__doc__ or "").strip() if module else "?"
            print(f"  slow compile {took:.1f} s: {title} ({path})", flush=True)
            if os.environ.get("OUT") and module:
                shutil.copy(path, os.environ["OUT"])
        return kernel
    return wrapper


def _instrument() -> None:
    runtime.GroupKernel._build = _report_builds(runtime.GroupKernel._build)
    triton.compiler.compile = _timed("triton compile", _report_slow_compiles(triton.compiler.compile))
    runtime.GroupKernel._build = _timed("kernel builds (codegen, compile, tune)", runtime.GroupKernel._build)
    runtime.GroupKernel._tune = _timed("autotuned builds", runtime.GroupKernel._tune)
    runtime.precompile = _timed("precompile on threads (wall)", runtime.precompile)
    timing.timed_median = _timed("timing configs", timing.timed_median)
    cluster_planes.load = _timed("cluster CUDA modules", cluster_planes.load)
    prefetch.walk = _timed("prefetch walks (codegen of every config, compiles queued)", prefetch.walk)
    # a warm start's parts: each partition's capture, plan and program, the generated modules, the CUDA graphs
    backend.StitchflowModule._compile = _timed("partitions compiled (capture, plan, program)",
                                               backend.StitchflowModule._compile)
    backend.regions_for = _timed("plans (regions_for)", backend.regions_for)
    program.Program.__init__ = _timed("Program() (prepare, compile regions)", program.Program.__init__)
    runtime.load_source = _timed("generated modules loaded", runtime.load_source)
    replay.GraphReplay._capture = _timed("CUDA graphs captured", replay.GraphReplay._capture)
    training._compile_half = _timed("AOT graphs handed over (partitioned, wrapped)", training._compile_half)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--app", default="resnet")
    p.add_argument("--size", default="default")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    _instrument()
    model, inputs, upstream = training_case(args.app, getattr(torch, args.dtype), args.size)
    eager = copy.deepcopy(model)
    for _ in range(3):
        _step(eager, eager, inputs, upstream)
    torch.cuda.synchronize()
    start = time.perf_counter()
    _step(eager, eager, inputs, upstream)
    torch.cuda.synchronize()
    eager_s = time.perf_counter() - start
    fn = _runner("backend=stitchflow", model)
    _report_every(30)
    print(f"threads compiling one space: {compiles.COMPILE_THREADS}; untimed below {runtime.TUNE_MIN_BYTES} bytes",
          flush=True)
    for step in range(3):
        start = time.perf_counter()
        _step(fn, model, inputs, upstream)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        print(f"step {step}: {wall:.2f} s (eager {eager_s * 1e3:.2f} ms)", flush=True)
        for name, value in sorted(TOTALS.items()):
            print(f"    {name}: {value:.2f}" if name.endswith(" s") else f"    {name}: {value}", flush=True)
        TOTALS.clear()
    print("ran eagerly:", list(backend.FALLBACKS)[:10], file=sys.stderr)


if __name__ == "__main__":
    main()
