"""Device probe: a ReLU MLP (OPT's shape of FFN) through stitchflow.compile on the GPU, against eager and
torch.compile, printing the chain plan the autotuner kept (cublas_lt puts the ReLU in cuBLASLt's epilogue).

    PYTHONPATH=. python scripts/relu_mlp_probe.py [--rows 8192] [--width 1024] [--hidden 4096] [--top-k 4]
"""
import argparse

import torch
import torch.nn as nn

import stitchflow
from stitchflow.targets.gpu.timing import graph_bench


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--top-k", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(args.width, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.width))
    mlp = mlp.to("cuda", torch.bfloat16).eval()
    x = torch.randn(args.rows, args.width, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = mlp(x)
        eager = graph_bench(lambda: mlp(x))[0] * 1e6
        print(f"eager {eager:.1f} us", flush=True)
        prog = stitchflow.compile(mlp, (x,), target="gpu", fusion="auto", options={"top_k": args.top_k})
        out = prog(x)
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        plans = [p for run in prog.compiled for s in getattr(run, "steps", ()) if isinstance(getattr(s, "plans", None), dict)
                 for p in s.plans.values()]  # a chain's run: shape -> the plan it kept
        ours = graph_bench(lambda: prog(x))[0] * 1e6
        print(f"stitchflow {ours:.1f} us ({eager / ours:.2f}x eager), rel err {err:.1e}, plans {[str(p) for p in plans]}",
              flush=True)
        compiled = torch.compile(mlp)
        compiled(x)
        tc = graph_bench(lambda: compiled(x))[0] * 1e6
        print(f"torch.compile {tc:.1f} us; stitchflow {tc / ours:.2f}x torch.compile", flush=True)


if __name__ == "__main__":
    main()
