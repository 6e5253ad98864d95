"""GPT-3 small with BigBird attention, whole model, three ways in one process (H100 probe, not a test):
the attention output stored contiguous (options attention_store=False), laid out as the output projection
walks it (walked_reads=False: the projection still reads it through digits, a contraction through torch),
and read as a plain [i, k] operand (the default: the projection matched as a GEMM with its bias and
residual). CUDA-graph medians, L2 evicted clean, rounds in turn.

    PYTHONPATH=. python scripts/gpt3_layout_probe.py [--block 64] [--rounds 3]
"""

import argparse
import copy
import statistics

import torch

import stitchflow
from stitchflow.apps.gpt3 import GPT3
from stitchflow.targets.gpu.timing import graph_bench

VARIANTS = {"contiguous": {"attention_store": False}, "walked, read through digits": {"walked_reads": False},
            "walked, plain GEMM": {}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    reference = GPT3.preset("gpt3-small", block=args.block).cuda()
    model = copy.deepcopy(reference).to(torch.bfloat16)
    x = torch.randn(1, 1024, 768, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        ref = reference(x.float())
        progs = {name: stitchflow.compile(model, (x,), target="gpu", fusion="auto",
                                          options={"cuda_graphs": False, **opts}) for name, opts in VARIANTS.items()}
        times = {name: [] for name in progs}
        for name, prog in progs.items():
            err = ((prog(x).float() - ref).norm() / ref.norm()).item()
            print(f"{name}: relative error {err:.1e}", flush=True)
        for _ in range(args.rounds):
            for name, prog in progs.items():
                times[name].append(graph_bench(lambda prog=prog: prog(x))[0] * 1e6)
    for name, ts in times.items():
        print(f"{name}: {statistics.median(ts):.1f} us (rounds {', '.join(f'{t:.1f}' for t in ts)})", flush=True)


if __name__ == "__main__":
    main()
