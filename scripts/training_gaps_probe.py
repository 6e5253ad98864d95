"""Device probe: why a training step's time spreads across rounds. Times every step of several rounds (runners
in turn, L2 evicted clean before each step, as the training bench does) and prints each round's median, 10th and
90th percentile; then profiles a few steps (CPU and CUDA) and lists the GPU's idle gaps inside a step, longest
first, with the kernels on either side and the host ops running while the GPU waited. Not a test.

    python scripts/training_gaps_probe.py [--app llama] [--rounds 5] [--runners "torch.compile,backend=stitchflow"]
"""
import argparse
import json
import statistics

import torch

from stitchflow.bench.training import _runner, _step, training_case
from stitchflow.targets.gpu.timing import flushed_times


def step_times(step, reps: int) -> list[float]:
    """Every step's µs between events, each after a clean L2 flush."""
    return [t * 1e6 for t in flushed_times(step, reps)]


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def gaps(step, steps: int = 3, top: int = 12):
    """The GPU's idle gaps inside the profiled steps (between consecutive kernels or copies of one step)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.cuda.synchronize()
            step()
        torch.cuda.synchronize()
    events = prof.events()
    gpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    found, busy = [], 0.0
    for a, b in zip(gpu, gpu[1:]):
        busy += a.time_range.end - a.time_range.start
        idle = b.time_range.start - a.time_range.end
        if 0 < idle < 2000:  # a gap between steps (the synchronize) is not inside a step
            found.append((idle, a, b))
    span = gpu[-1].time_range.end - gpu[0].time_range.start if gpu else 0.0
    print(f"  profiled {steps} steps: {len(gpu)} GPU events, busy {busy / steps:.0f} us per step, "
          f"idle gaps < 2 ms {sum(g for g, _, _ in found) / steps:.0f} us per step (span {span:.0f} us)")
    for idle, a, b in sorted(found, key=lambda t: -t[0])[:top]:
        host = sorted({e.name for e in cpu if e.time_range.start < b.time_range.start and
                       e.time_range.end > a.time_range.end and e.time_range.end - e.time_range.start < 5 * idle + 50})
        print(f"  {idle:7.1f} us idle after {a.name[:50]!r} before {b.name[:50]!r}; host: {', '.join(host)[:200]}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--app", default="llama")
    p.add_argument("--size", default="default")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--runners", default="torch.compile,backend=stitchflow")
    p.add_argument("--options", default="{}", help="the stitchflow backend's options, as JSON")
    args = p.parse_args()
    steps = {}
    for name in args.runners.split(","):
        torch._dynamo.reset()
        model, inputs, upstream = training_case(args.app, getattr(torch, args.dtype), args.size)
        fn = _runner(name, model, json.loads(args.options))
        steps[name] = lambda fn=fn, model=model, inputs=inputs, upstream=upstream: _step(fn, model, inputs, upstream)
        for _ in range(5):
            steps[name]()
        torch.cuda.synchronize()
    for r in range(args.rounds):
        for name, step in steps.items():
            t = step_times(step, args.reps)
            print(f"round {r} {name:22s} median {statistics.median(t):7.0f}  p10 {quantile(t, 0.1):7.0f}  "
                  f"p90 {quantile(t, 0.9):7.0f}  min {min(t):7.0f}  max {max(t):7.0f} us", flush=True)
    for name, step in steps.items():
        print(f"{name}:")
        gaps(step)


if __name__ == "__main__":
    main()
