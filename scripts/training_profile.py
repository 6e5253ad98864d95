"""Device probe: where a training step's time goes under torch.compile(backend="stitchflow"): the CUDA
kernels of one forward+backward step (torch.profiler), largest first, and the regions of each compiled
partition with their kind. Not a test.

    python scripts/training_profile.py [--app llama] [--size default] [--dtype bfloat16] [--options '{"cuda_graphs": false}']

With --by-shape, the host table groups ops by input shape (with CUDA graphs off, it says which aten op launched
each torch kernel).
"""
import argparse
import json

import torch

import stitchflow.backend as backend
from stitchflow.bench.training import _runner, _step, training_case


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--app", default="llama")
    p.add_argument("--size", default="default")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--runner", default="backend=stitchflow")
    p.add_argument("--options", default="{}", help="the stitchflow backend's options, as JSON")
    p.add_argument("--by-shape", action="store_true")
    p.add_argument("--rows", type=int, default=25, help="rows of the kernel table")
    p.add_argument("--timeline", action="store_true", help="every kernel of the step in launch order, with its time")
    p.add_argument("--by-kind", action="store_true", help="kernel time summed by kind (convolutions, GEMMs, "
                   "generated, torch's elementwise and copies), then stop")
    p.add_argument("--launchers", metavar="REGEX", help="every kernel whose name matches, with the chain of ops that "
                   "launched it and their input shapes (run with --options '{\"cuda_graphs\": false}'), then stop")
    args = p.parse_args()
    model, inputs, upstream = training_case(args.app, getattr(torch, args.dtype), args.size)
    fn = _runner(args.runner, model, json.loads(args.options))
    for _ in range(3):
        _step(fn, model, inputs, upstream)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _step(fn, model, inputs, upstream)
    torch.cuda.synchronize()
    print(f"memory during a step: peak allocated {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB, peak reserved "
          f"{torch.cuda.max_memory_reserved() / 2**20:.0f} MiB (model, inputs, gradients, what the runner keeps)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _step(fn, model, inputs, upstream)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=90))
    if args.timeline:
        kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: e.time_range.start)
        for k, e in enumerate(kernels):
            print(f"{k:4d} {e.time_range.start - kernels[0].time_range.start:9.1f} us  {e.device_time:8.1f} us  "
                  f"{e.name[:90]}")
    if args.launchers:
        print_launchers(fn, model, inputs, upstream, args.launchers)
        return
    if args.by_kind:
        print_by_kind(prof)
        print_regions()
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                record_shapes=args.by_shape) as host_prof:
        _step(fn, model, inputs, upstream)
        torch.cuda.synchronize()
    if args.by_shape:
        print(host_prof.key_averages(group_by_input_shape=True).table(
            sort_by="device_time_total", row_limit=60, max_name_column_width=40, max_shapes_column_width=90))
    else:
        print(host_prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    kernels = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    import cProfile
    import pstats
    import time

    torch.cuda.synchronize()
    start = time.perf_counter()
    with cProfile.Profile() as host:
        for _ in range(5):
            _step(fn, model, inputs, upstream)
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / 5 * 1e3
    print(f"step: {wall:.2f} ms wall (under cProfile), {kernels:.2f} ms of kernels")
    pstats.Stats(host).sort_stats("tottime").print_stats(25)
    # host time of each region step (no sync: what the Python costs), and the step's wall time
    spent = {}
    for m in backend.COMPILED:
        for prog in m.programs.values():
            for run in (prog._compiled if prog is not None else ()):
                for k, step in enumerate(getattr(run, "steps", ())):
                    label = f"{m.name} {type(step).__name__} {getattr(getattr(step, 'node', None), 'name', k)}"

                    def timed(env, step=step, label=label):
                        t0 = time.perf_counter()
                        step(env)
                        spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0
                    run.steps[k] = timed
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        _step(fn, model, inputs, upstream)
    torch.cuda.synchronize()
    print(f"step: {(time.perf_counter() - start) / 10 * 1e3:.2f} ms wall, steps' host time "
          f"{sum(spent.values()) / 10 * 1e3:.2f} ms")
    for label, t in sorted(spent.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {t / 10 * 1e6:8.1f} us  {label}")
    print_regions()


def print_regions() -> None:
    """Every compiled partition's regions, with what runs each."""
    for m in backend.COMPILED:
        for prog in m.programs.values():
            if prog is None:
                continue
            for region, compiled in zip(prog.regions, prog._compiled):
                print(m.name, type(compiled).__name__, str(region)[:150])
                for step in getattr(compiled, "steps", ()):
                    if type(step).__name__ == "TorchStep":  # a node run through torch, with the reason
                        print("   ", step, [tuple(prog.graph.type_of[step.node.name].shape)])


def print_launchers(fn, model, inputs, upstream, pattern: str) -> None:
    """Each kernel matching `pattern` under the host op that launched it, that op's parents, and the shapes."""
    import re
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                record_shapes=True) as prof:
        _step(fn, model, inputs, upstream)
        torch.cuda.synchronize()
    rows = []
    for e in prof.events():
        for k in getattr(e, "kernels", ()):
            if re.search(pattern, k.name):
                chain, parent = [], e.cpu_parent
                while parent is not None:
                    chain.append(parent.name)
                    parent = parent.cpu_parent
                rows.append((e.time_range.start, k.duration, e.name, e.input_shapes, " < ".join(chain[:4])))
    print(f"{len(rows)} kernels matching {pattern!r}, {sum(r[1] for r in rows):.1f} us:")
    for _, us, name, shapes, chain in sorted(rows):
        print(f"  {us:7.1f} us  {name} {str(shapes)[:110]}  < {chain[:160]}")


KINDS = (  # first match wins; names as the CUDA profiler reports them
    ("generated (Triton)", r"^triton_|^sf_"),
    ("convolution (cuDNN)", r"conv|xmma|cudnn|implicit_convolve|wgrad|dgrad|fprop|nchwToNhwc|nhwcToNchw"),
    ("GEMM (cuBLAS)", r"gemm|cutlass|sm90_|nvjet|splitK"),
    ("copies", r"copy|Memcpy|Memset|fill"),
    ("torch elementwise / reductions", r"elementwise|reduce|batch_norm|vectorized|CatArray|index"),
)


def print_by_kind(prof) -> None:
    """Kernel time per kind (µs per step), and each kind's three largest kernels."""
    import re
    totals, members = {}, {}
    for e in prof.key_averages():
        if e.self_device_time_total <= 0:
            continue
        kind = next((k for k, pattern in KINDS if re.search(pattern, e.key, re.I)), "other")
        totals[kind] = totals.get(kind, 0.0) + e.self_device_time_total
        members.setdefault(kind, []).append((e.self_device_time_total, e.count, e.key))
    print(f"kernel time by kind: {sum(totals.values()):.0f} us in all")
    for kind, total in sorted(totals.items(), key=lambda kv: -kv[1]):
        top = sorted(members[kind], reverse=True)[:3]
        print(f"  {total:8.0f} us  {sum(c for _, c, _ in members[kind]):4d} launches  {kind}")
        for t, c, name in top:
            print(f"      {t:8.0f} us  x{c:<4d} {name[:100]}")


if __name__ == "__main__":
    main()
