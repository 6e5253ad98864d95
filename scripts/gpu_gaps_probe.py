"""Device probe: where the GPU sits idle during a call. For each model (NAME or NAME:SIZE of apps/hf.py or the
zoo, bf16, CUDA) and runner (eager, torch.compile, stitchflow, stitchflow-all: every config timed), a few calls under torch.profiler; the device
activities (kernels, copies, memsets) of the last call sorted by start, the busy time against the span from the
first start to the last end, and the largest gaps between activities with what ran on either side. Also the
host time of one call (no synchronisation) and of one synchronised call. Not a test.

    python scripts/gpu_gaps_probe.py [hf-llama:padded,hf-llama] [--runners torch.compile,stitchflow] [--top 12] [--timeline]
"""

import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import stitchflow.backend as backend
from stitchflow.apps import build_model
from stitchflow.targets.gpu.timing import flushed_times


def device_events(prof):
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            out.append((e.time_range.start, e.time_range.end, e.name))
    return sorted(out)


def split_calls(events, calls):
    """The device events of the last call: the last 1/calls of the events by count (calls are alike)."""
    per = len(events) // calls
    return events[-per:] if per else events


def report(events, top):
    busy = sum(end - start for start, end, _ in events)
    span = events[-1][1] - events[0][0]
    gaps = []
    for (s0, e0, n0), (s1, e1, n1) in zip(events, events[1:]):
        if s1 > e0:
            gaps.append((s1 - e0, n0, n1))
    gaps.sort(reverse=True)
    print(f"    activities {len(events)}; busy {busy:.0f} us of a {span:.0f} us span; idle {span - busy:.0f} us "
          f"in {sum(1 for g in gaps if g[0] > 2)} gaps over 2 us")
    for gap, before, after in gaps[:top]:
        print(f"    {gap:8.1f} us  after {before[:70]}  |  before {after[:70]}")


def timeline(events):
    t0 = events[0][0]
    for start, end, name in events:
        print(f"    {start - t0:8.1f} +{end - start:7.1f} us  {name[:100]}")


def steady_span(fn, inputs, calls=6):
    """Device span per call of calls queued back to back while the GPU first sleeps (the host ahead)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(20e-3 * 2e9))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn(*inputs)
    start.record()
    for _ in range(calls):
        fn(*inputs)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def host_times(fn, inputs, calls=20):
    hosts, synced = [], []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*inputs)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        hosts.append((t1 - t0) * 1e6)
        synced.append((t2 - t0) * 1e6)
    return statistics.median(hosts), statistics.median(synced)


def main():
    args = sys.argv[1:]
    names = (args[0] if args and not args[0].startswith("-") else "hf-llama:padded").split(",")
    runners = args[args.index("--runners") + 1].split(",") if "--runners" in args else ["torch.compile", "stitchflow"]
    top = int(args[args.index("--top") + 1]) if "--top" in args else 12
    calls = 3
    for spec in names:
        name, _, size = spec.partition(":")
        model, inputs = build_model(name, size or "default", dtype=torch.bfloat16)
        model = model.cuda().eval()
        inputs = tuple(x.cuda() for x in inputs)
        print(f"== {spec}", flush=True)
        for runner in runners:
            torch._dynamo.reset()
            backend.reset()
            options = {"autotune": "all"} if runner == "stitchflow-all" else {}
            fn = (model if runner == "eager" else torch.compile(model, dynamic=False) if runner == "torch.compile"
                  else torch.compile(model, backend="stitchflow", dynamic=False, options=options))
            with torch.no_grad():
                for _ in range(4):
                    fn(*inputs)
                torch.cuda.synchronize()
                host, synced = host_times(fn, inputs)
                with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    for _ in range(calls):
                        fn(*inputs)
                        torch.cuda.synchronize()
                steady = statistics.median(steady_span(fn, inputs) for _ in range(3))
                flushed = statistics.median(flushed_times(lambda: fn(*inputs), 20)) * 1e6
            print(f"  -- {runner}: host {host:.0f} us a call, synchronised call {synced:.0f} us, back to back "
                  f"{steady:.0f} us a call, each after an L2 flush {flushed:.0f} us", flush=True)
            last = split_calls(device_events(prof), calls)
            report(last, top)
            if "--timeline" in args:
                timeline(last)


if __name__ == "__main__":
    main()
