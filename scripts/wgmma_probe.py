"""Device probe: the Gluon wgmma chain kernel against eager, torch.compile and the Triton resident
kernel on the memory-bound chains (correctness and CUDA-graph timing). Not a test: prints a table."""
import sys
import time

import torch
import torch.nn.functional as F

from stitchflow.targets.gpu.chain_resident import ResidentTiles, resident_chain
from stitchflow.targets.gpu.chain_wgmma import WgmmaTiles, chain_wgmma
from stitchflow.targets.gpu.timing import graph_bench

SHAPES = {"65536x64-256-64": (65536, 64, 256, 64, ResidentTiles(bm=128, bn=256, num_warps=8, programs_per_sm=1)),
          "16384x128-512-128": (16384, 128, 512, 128, ResidentTiles(bm=128, bn=128, num_warps=8, programs_per_sm=1))}
VARIANTS = {"65536x64-256-64": [WgmmaTiles(64, 128, 4, 2, 2, 2), WgmmaTiles(128, 128, 8, 2, 2, 1)],
            "16384x128-512-128": [WgmmaTiles(64, 64, 4, 2, 2, 2), WgmmaTiles(128, 64, 8, 2, 2, 1),
                                  WgmmaTiles(128, 64, 8, 2, 3, 1), WgmmaTiles(128, 128, 8, 2, 2, 1)]}
ACTS = ("none", "gelu", "gelu_pairs", "gelu_tanh")


def main():
    only = sys.argv[1:] or list(SHAPES)
    torch.manual_seed(0)
    for name in only:
        M, K, N, L, rtiles = SHAPES[name]
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(K, N, device="cuda") / K ** 0.5).to(torch.bfloat16)
        d = (torch.randn(N, L, device="cuda") / N ** 0.5).to(torch.bfloat16)
        eager = lambda: F.gelu(a @ b) @ d
        comp = torch.compile(lambda a, b, d: F.gelu(a @ b) @ d)
        rows = [("eager", graph_bench(eager)[0]), ("torch.compile", graph_bench(lambda: comp(a, b, d))[0]),
                ("triton resident", graph_bench(lambda: resident_chain(a, b, d, act="gelu", tiles=rtiles))[0])]
        for t in VARIANTS[name]:
            for act in ACTS:
                try:
                    out = chain_wgmma(a, b, d, act=act, tiles=t)
                    fn = {"none": lambda v: v, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}.get(act, F.gelu)
                    want = fn(a.float() @ b.float()).to(torch.bfloat16).float() @ d.float()
                    err = ((out.float() - want).abs().max() / want.abs().max()).item()
                    rows.append((f"{t} {act} err={err:.1e}", graph_bench(lambda: chain_wgmma(a, b, d, act=act, tiles=t))[0]))
                except Exception as e:  # report and go on: a probe
                    rows.append((f"{t} {act} FAILED {type(e).__name__}: {str(e)[:200]}", float("nan")))
        base = min(rows[0][1], rows[1][1])
        print(f"\n## {name}  ({torch.cuda.get_device_name()})")
        for label, s in rows:
            print(f"{s * 1e6:8.1f} us  {base / s:5.2f}x  {label}", flush=True)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"probe took {time.time() - t0:.0f} s")
