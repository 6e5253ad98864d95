"""Device probe: which torch ops launch a call's kernels under torch.compile(backend="stitchflow"), the program run
without a CUDA graph so that the profiler sees the ops (a replay shows only kernels). Not a test.

    PYTHONPATH=. python scripts/hf_ops_probe.py [hf-opt | hf-llama:padded] [--rows 30]
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import stitchflow.backend  # noqa: F401  (registers the backend)
from stitchflow.apps import build_model


def main():
    args = sys.argv[1:]
    name, _, size = (args[0] if args and not args[0].startswith("--") else "hf-opt").partition(":")
    rows = int(args[args.index("--rows") + 1]) if "--rows" in args else 30
    model, inputs = build_model(name, size=size or "default", dtype=torch.bfloat16)
    model = model.cuda()
    inputs = tuple(x.cuda() for x in inputs)
    fn = torch.compile(model, backend="stitchflow", dynamic=False, options={"autotune": "all", "cuda_graphs": False})
    with torch.no_grad():
        for _ in range(3):
            fn(*inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn(*inputs)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
