"""Device probe: where a GNN's time goes under eager and under stitchflow's gpu target (torch.profiler's CUDA
kernel totals per call, plain calls without a CUDA graph). Not a test.

    PYTHONPATH=.:scripts python3 scripts/gnn_profile.py [gcn|graphsage] [dataset]
"""
import sys

import torch
from launch_overhead_probe import profiled

import stitchflow
from stitchflow.apps import APPS


def kernels(fn, calls: int = 10) -> None:
    prof = profiled(fn, calls, warmup=3)
    rows = [(e.device_time_total / calls, e.count // calls, e.key) for e in prof.key_averages()
            if e.device_time_total > 0]
    for us, count, key in sorted(rows, reverse=True)[:12]:
        print(f"  {us:9.1f} us  x{count:<3d} {key[:110]}")
    print(f"  total {sum(r[0] for r in rows):.1f} us per call", flush=True)


def main():
    app, dataset = (sys.argv[1:] + ["graphsage", "arxiv-synthetic"][len(sys.argv[1:]):])[:2]
    model, (a, x) = APPS[app].build(size="default", dataset=dataset)
    model, a, x = model.cuda(), a.cuda(), x.cuda()
    prog = stitchflow.compile(model, (a, x), target="gpu", fusion="auto", options={"cuda_graphs": False})
    with torch.no_grad():
        print(f"{app} on {dataset}: eager")
        kernels(lambda: model(a, x))
        print("stitchflow (gpu target, no CUDA graph)")
        kernels(lambda: prog(a, x))
        print("steps:", [str(s)[:80] for run in prog._compiled for s in run.steps])


if __name__ == "__main__":
    main()
