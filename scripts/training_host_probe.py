"""Device probe: where a training step's host time goes under torch.compile(backend="stitchflow"):
per partition, whether its program replays a CUDA graph (and why not), the host time of its calls
split into lookup, argument set-up and launches, kernel builds during timed steps (a signature that
changes every call), and the caching allocator's device allocations per step. Not a test.

    python scripts/training_host_probe.py [--app resnet] [--steps 10]
"""
import argparse
import collections
import time

import torch

import stitchflow.backend as backend
import stitchflow.targets.gpu.runtime as runtime
from stitchflow.bench.training import _runner, _step, training_case

SPENT = collections.Counter()
CALLS = collections.Counter()


def timed(owner, name, label):
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - t0
            CALLS[label] += 1

    setattr(owner, name, wrapper)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--app", default="resnet")
    p.add_argument("--size", default="default")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--plain", action="store_true", help="time every program's plain calls (no CUDA graph)")
    args = p.parse_args()
    model, inputs, upstream = training_case(args.app, getattr(torch, args.dtype), args.size)
    fn = _runner("backend=stitchflow", model)
    for _ in range(4):
        _step(fn, model, inputs, upstream)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        _step(fn, model, inputs, upstream)
    torch.cuda.synchronize()
    print(f"step, uninstrumented: {(time.perf_counter() - start) / args.steps * 1e3:.2f} ms")
    for m in backend.COMPILED:
        for prog in m.programs.values():
            if prog is None:
                continue
            replay = prog._replay
            state = ("no replayer" if replay is None else "replays" if replay.graph is not None
                     else f"plain: {replay.failed}")
            kernels = sum(len(getattr(run, "kernels", ())) for run in prog._compiled)
            if replay is not None:
                state += f" (plain {replay.plain_ms}, replay {replay.replay_ms})"
            print(f"{m.name}: {len(prog.regions)} regions, {kernels} kernels, {len(prog.graph.inputs)} inputs, "
                  f"{len(prog.graph.outputs)} outputs, {len(prog.captured.layouts)} permuted; {state}")
    if args.plain:  # every program without its CUDA graph: where a plain call's host time goes
        for m in backend.COMPILED:
            for prog in m.programs.values():
                if prog is not None and prog._replay is not None:
                    prog._replay._release()
                    prog._replay.failed = "probe: plain calls"
        for _ in range(2):
            _step(fn, model, inputs, upstream)
        import stitchflow.program as program
        import stitchflow.targets.gpu.grouping as grouping
        timed(program.Program, "_run", "Program._run")
        timed(program.Program, "_bind", "Program._bind")
        timed(program, "rebuild_outputs", "rebuild_outputs")
        timed(grouping.TorchStep, "__call__", "TorchStep.__call__")
    timed(runtime.GroupKernel, "__call__", "GroupKernel.__call__ (all)")
    timed(runtime.GroupKernel, "_signature", "GroupKernel._signature")
    timed(runtime.GroupKernel, "_build", "GroupKernel._build (rebuilds!)")
    timed(runtime.Launch, "_arguments", "Launch._arguments")
    timed(runtime.Launch, "__call__", "Launch.__call__ (incl. arguments)")
    timed(backend.StitchflowModule, "forward", "StitchflowModule.forward (all)")
    stats0 = torch.cuda.memory_stats()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        _step(fn, model, inputs, upstream)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.steps * 1e3
    stats1 = torch.cuda.memory_stats()
    print(f"step, instrumented: {wall:.2f} ms")
    for label, t in SPENT.most_common():
        print(f"  {t / args.steps * 1e3:8.3f} ms/step  {CALLS[label] / args.steps:6.1f} calls/step  {label}")
    for key in ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams"):
        if key in stats0:
            print(f"  {key}: {(stats1[key] - stats0[key]) / args.steps:.1f} per step")


if __name__ == "__main__":
    main()
