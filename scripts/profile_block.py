"""Where a transformer block's time goes under stitchflow.compile(target="gpu"), on the GPU.

    python scripts/profile_block.py [--apps llama,bert] [--steps llama] [--e2e llama,bert]
                                    [--no-torch-compile] [--profiler]

--steps APP: every step of the program (generated kernels, GEMMs through torch, chain
  kernels) timed on its own with CUDA events (median of --reps runs, outside a CUDA graph);
  for each generated kernel its nodes, parts (parallel/local axes), chosen config, grid,
  bytes moved (external inputs read once + outputs written) and the achieved bandwidth.
--e2e APPS: end-to-end medians (triton.testing.do_bench) of eager, torch.compile and
  stitchflow.compile (CUDA-graph replay), with the relative error against eager.
--profiler: also a torch.profiler table of the stitchflow program (kernel names say which
  generated group each launch is: sf_<region>_<first node>__<last node>).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import stitchflow
from stitchflow.apps import APPS


def _build(app: str, size: str):
    model, inputs = APPS[app].build(size=size, dtype=torch.bfloat16)
    model = model.cuda()
    inputs = tuple(x.cuda() if isinstance(x, torch.Tensor) else x for x in inputs)
    return model, inputs


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _describe(step) -> str:
    from stitchflow.targets.gpu.runtime import GroupKernel

    if isinstance(step, GroupKernel):
        return f"kernel {step.title}"
    if hasattr(step, "spec"):  # a chain
        plans = "; ".join(str(p) for p in getattr(step, "plans", {}).values())
        return f"chain {'->'.join(step.spec.nodes)} [{plans[:160]}]"
    return str(step)[:160]


GRAPH_REPS = 5


def _graph_time(step, env) -> float | None:
    """Microseconds of one run of `step` on the GPU alone: GRAPH_REPS runs captured in one CUDA
    graph and replayed, so the host's dispatch (Python, einsum planning) is not counted."""
    try:
        scratch = dict(env)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(scratch)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(GRAPH_REPS):
                step(scratch)
        g.replay()
        torch.cuda.synchronize()
        runs = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            torch.cuda.synchronize()
            runs.append(start.elapsed_time(end) * 1e3 / GRAPH_REPS)
        del g
        return statistics.median(runs)
    except Exception as err:  # a step that cannot be captured: report the in-sequence time
        print(f"  (no graph for {_describe(step)[:60]}: {type(err).__name__})", flush=True)
        return None


def step_times(app: str, size: str, reps: int) -> list[dict]:
    from stitchflow.targets.gpu.mapping import programs
    from stitchflow.targets.gpu.runtime import GroupKernel

    model, inputs = _build(app, size)
    t0 = time.time()
    prog = stitchflow.compile(model, inputs, target="gpu", fusion="auto", options={"cuda_graphs": False})
    with torch.no_grad():
        for _ in range(2):  # builds and autotunes every kernel
            prog(*inputs)
        torch.cuda.synchronize()
        print(f"[{app}] compile + autotune {time.time() - t0:.1f} s", flush=True)
        steps = [(r, s) for r, run in enumerate(prog._compiled) for s in run.steps]
        times = {k: [] for k in range(len(steps))}
        for _ in range(reps):
            env = prog._bind(inputs)
            events = [torch.cuda.Event(enable_timing=True) for _ in range(len(steps) + 1)]
            events[0].record()
            for k, (_, s) in enumerate(steps):
                s(env)
                events[k + 1].record()
            torch.cuda.synchronize()
            for k in range(len(steps)):
                times[k].append(events[k].elapsed_time(events[k + 1]) * 1e3)
        alone = {k: _graph_time(s, env) for k, (_, s) in enumerate(steps)}
    rows, total, total_alone = [], 0.0, 0.0
    for k, (r, s) in enumerate(steps):
        us = alone[k] if alone[k] is not None else statistics.median(times[k])
        total += statistics.median(times[k])
        total_alone += us
        row = {"step": k, "region": prog.regions[r].name, "what": _describe(s), "us": round(us, 1),
               "us_in_sequence": round(statistics.median(times[k]), 1)}
        if isinstance(s, GroupKernel):
            names = [n.name for p in s.plans for n in p.nodes]
            launch = next(iter(s._built.values()), None)
            spec = launch.spec if launch else None
            moved = sum(_nbytes(env.get(t)) for t in s.inputs)
            outs = spec.outputs if spec else ()
            moved += sum(_nbytes(env.get(t)) for t in outs)
            row.update(nodes=names, outputs=list(outs), bytes=moved, GBps=round(moved / us * 1e-3, 1),
                       configs=[str(c) for c in (s.chosen or [])], grid=spec.grid if spec else None,
                       phases=spec.phases if spec else None, name=spec.name if spec else None,
                       parts=[{"P": [p.extents[c] for c in p.P], "L": [p.extents[c] for c in p.L],
                               "outputs": list(p.outputs), "transposed": p.transposed,
                               "programs": programs(p, c) if c is not None else None}
                              for p, c in zip(s.plans, s.chosen or [None] * len(s.plans))])
        rows.append(row)
    print(f"[{app}] steps: GPU time of each step alone (its own CUDA graph, {GRAPH_REPS} launches per replay; "
          f"in-sequence medians of {reps} eager runs in the json):", flush=True)
    for row in sorted(rows, key=lambda x: -x["us"]):
        extra = ""
        if "nodes" in row:
            extra = (f" | {row['GBps']} GB/s, {row['bytes'] / 2**20:.1f} MiB | cfg {row['configs']} grid {row['grid']}"
                     f" | parts {[(p['P'], p['L']) for p in row['parts']]} | nodes {row['nodes']}")
        print(f"  {row['us']:9.1f} us  #{row['step']:<2} {row['region']:4} {row['what'][:110]}{extra}", flush=True)
    print(f"[{app}] sum of steps alone {total_alone:.1f} us; in sequence without a graph {total:.1f} us", flush=True)
    return rows


def e2e(app: str, size: str, with_compile: bool) -> dict:
    from triton.testing import do_bench

    from stitchflow.bench.stitching_patterns import as_tuple, relative_error

    torch._dynamo.reset()
    model, inputs = _build(app, size)
    row = {"app": app, "size": size}
    with torch.no_grad():
        ref = as_tuple(model(*inputs))[0]
        runners = {"eager": lambda: model}
        if with_compile:
            runners["torch.compile"] = lambda: torch.compile(model, dynamic=False)
        runners["stitchflow.compile"] = lambda: stitchflow.compile(model, inputs, target="gpu", fusion="auto")
        for name, make in runners.items():
            t0 = time.time()
            fn = make()
            row[f"{name} err"] = relative_error(as_tuple(fn(*inputs))[0], ref)
            for _ in range(3):
                fn(*inputs)
            row[f"{name} us"] = round(do_bench(lambda: fn(*inputs), warmup=10, rep=60, return_mode="median") * 1e3, 1)
            row[f"{name} setup s"] = round(time.time() - t0, 1)
    if with_compile:
        row["stitchflow vs torch.compile"] = round(row["torch.compile us"] / row["stitchflow.compile us"], 3)
    print(json.dumps(row), flush=True)
    return row


def profile(app: str, size: str) -> None:
    model, inputs = _build(app, size)
    prog = stitchflow.compile(model, inputs, target="gpu", fusion="auto", options={"cuda_graphs": False})
    with torch.no_grad():
        for _ in range(3):
            prog(*inputs)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                prog(*inputs)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("app", nargs="?", default=None, help="shorthand for --steps APP --profiler")
    parser.add_argument("--steps", default="")
    parser.add_argument("--e2e", default="")
    parser.add_argument("--size", default="default")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--no-torch-compile", action="store_true")
    parser.add_argument("--profiler", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    steps = [a for a in args.steps.split(",") if a] or ([args.app] if args.app else [])
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    report = {"steps": {}, "e2e": []}
    for app in steps:
        report["steps"][app] = step_times(app, args.size, args.reps)
        if args.profiler or args.app:
            profile(app, args.size)
    for app in [a for a in args.e2e.split(",") if a]:
        report["e2e"].append(e2e(app, args.size, not args.no_torch_compile))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
