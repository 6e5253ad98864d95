"""Does Program's CUDA-graph replay pay for itself? For single-kernel patterns and for the
transformer blocks: per-call medians with replay allowed (the adaptive default) and with
cuda_graphs=False, and which way the program decided. Run on a GPU:

    PYTHONPATH=. python3 scripts/replay_check.py [--patterns bias_gelu,add_layernorm_gelu] [--apps bert,llama]
"""

import argparse
import json

import torch
import triton.testing

import stitchflow
from stitchflow.apps import APPS
from stitchflow.bench.stitching_patterns import PATTERNS


def per_call_us(fn, args) -> float:
    return 1e3 * triton.testing.do_bench(lambda: fn(*args), warmup=50, rep=300, return_mode="median")


def check(name, module, inputs, dtype):
    row = {"case": name}
    with torch.no_grad():
        ref = module(*inputs)
        for label, opts in (("adaptive", {}), ("no_graphs", {"cuda_graphs": False})):
            prog = stitchflow.compile(module, inputs, target="gpu", fusion="auto" if name in APPS else "full",
                                      options=opts)
            for _ in range(4):  # warm-up, the timed call, the capture (if any)
                out = prog(*inputs)
            err = (out.float() - ref.float()).norm() / ref.float().norm()
            row[label + "_us"] = round(per_call_us(prog, inputs), 1)
            row[label + "_relerr"] = float(err)
            replay = prog._replay
            row[label + "_graph"] = None if replay is None else ("graph" if replay.graph is not None else replay.failed)
    print(json.dumps(row), flush=True)
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--patterns", default="bias_gelu,add_layernorm_gelu,scale_mask_softmax")
    p.add_argument("--apps", default="bert,llama")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)  # the patterns draw on the CPU, then move
    for name in filter(None, args.patterns.split(",")):
        pat = PATTERNS[name]
        check(name, pat.module().cuda(), pat.make(pat.large, pat.dtype, "cuda", gen), pat.dtype)
    for app in filter(None, args.apps.split(",")):
        model, inputs = APPS[app].build(size="default", dtype=torch.bfloat16)
        model = model.cuda().eval()
        inputs = tuple(x.cuda() if isinstance(x, torch.Tensor) else x for x in inputs)
        check(app, model, inputs, torch.bfloat16)


if __name__ == "__main__":
    main()
