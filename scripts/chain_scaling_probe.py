"""Device probe: where a memory-bound chain's time goes. Times the wgmma chain kernel over a sweep of M (slope = cost
per row tile, intercept = fixed cost: launch, weight loads, pipeline fill, tail) next to a copy of A's and E's bytes,
all CUDA-graph medians after a clean L2 flush. Not a test: prints a table.
Usage: python scripts/chain_scaling_probe.py [K N L]  (default 64 256 64)"""
import sys

import torch

from stitchflow.targets.gpu.chain_wgmma import WgmmaTiles, chain_wgmma
from stitchflow.targets.gpu.timing import graph_bench

K, N, L = (int(v) for v in (sys.argv[1:4] or (64, 256, 64)))
TILES = {64: WgmmaTiles(64, 128, 4, 2, 2, 2), 128: WgmmaTiles(64, 64, 4, 2, 2, 2)}[K]
torch.manual_seed(0)
b = (torch.randn(K, N, device="cuda") / K ** 0.5).to(torch.bfloat16)
d = (torch.randn(N, L, device="cuda") / N ** 0.5).to(torch.bfloat16)
print(f"{K}x{N}x{L} {TILES}\n{'M':>7} {'tiles/prog':>10} {'copy us':>8} {'none us':>8} {'gelu us':>8}")
for M in (64 * 264, 2 * 64 * 264, 4 * 64 * 264, 8 * 64 * 264, 16 * 64 * 264):
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(M, L, device="cuda", dtype=torch.bfloat16)
    copy = graph_bench(lambda: out.copy_(a))[0] if K == L else float("nan")
    times = [graph_bench(lambda: chain_wgmma(a, b, d, act=act, tiles=TILES))[0] for act in ("none", "gelu")]
    print(f"{M:7d} {M / 64 / 264:10.2f} {copy * 1e6:8.1f} " + " ".join(f"{t * 1e6:8.1f}" for t in times), flush=True)
