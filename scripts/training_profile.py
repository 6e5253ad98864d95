"""Device probe: where a training step's time goes under torch.compile(backend="stitchflow"): the CUDA
kernels of one forward+backward step (torch.profiler), largest first, and the regions of each compiled
partition with their kind. Not a test.

    python scripts/training_profile.py [--app llama] [--size default] [--dtype bfloat16]
"""
import argparse
import copy

import torch

import stitchflow.backend as backend
from stitchflow.bench.training import _runner, _step
from stitchflow.apps import APPS


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--app", default="llama")
    p.add_argument("--size", default="default")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--runner", default="backend=stitchflow")
    args = p.parse_args()
    torch.manual_seed(0)
    model, inputs = APPS[args.app].build(size=args.size, dtype=getattr(torch, args.dtype))
    model = model.cuda().train()
    inputs = tuple(x.cuda().requires_grad_(k == 0) for k, x in enumerate(inputs))
    fn = _runner(args.runner, model)
    upstream = torch.randn_like(model(*inputs)[0] if isinstance(model(*inputs), tuple) else model(*inputs))
    for _ in range(3):
        _step(fn, model, inputs, upstream)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _step(fn, model, inputs, upstream)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))
    for m in backend.COMPILED:
        for prog in m.programs.values():
            if prog is None:
                continue
            for region, compiled in zip(prog.regions, prog._compiled):
                print(m.name, type(compiled).__name__, str(region)[:150])


if __name__ == "__main__":
    main()
