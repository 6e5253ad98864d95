"""Device probe: where the memory-bound chain's time goes. Times the wgmma chain kernel over a sweep of M
(slope = cost per row tile, intercept = fixed cost: launch, weight loads, pipeline fill, tail) next to a copy of
the same bytes, all as CUDA-graph medians after a clean L2 flush. Not a test: prints a table."""
import torch

from stitchflow.targets.gpu.chain_wgmma import WgmmaTiles, chain_wgmma
from stitchflow.targets.gpu.timing import graph_bench

K, N, L = 64, 256, 64
VARIANTS = [WgmmaTiles(64, 128, 4, 2, 2, 2), WgmmaTiles(64, 64, 4, 2, 2, 2), WgmmaTiles(64, 128, 4, 3, 2, 2)]
torch.manual_seed(0)
b = (torch.randn(K, N, device="cuda") / 8).to(torch.bfloat16)
d = (torch.randn(N, L, device="cuda") / 16).to(torch.bfloat16)
print(f"{'M':>7} {'tiles/prog':>10} {'copy us':>8} {'none us':>8} {'gelu us':>8} {'relu us':>8}  tiles")
for M, TILES in [(m, t) for t in VARIANTS for m in (64 * 264, 65536, 262144)]:
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(M, L, device="cuda", dtype=torch.bfloat16)
    copy = graph_bench(lambda: out.copy_(a))[0]
    if M == 65536:
        want = torch.nn.functional.gelu(a.float() @ b.float()).to(torch.bfloat16).float() @ d.float()
        got = chain_wgmma(a, b, d, act="gelu", tiles=TILES).float()
        print(f"  error {((got - want).abs().max() / want.abs().max()).item():.1e}")
    times = [graph_bench(lambda: chain_wgmma(a, b, d, act=act, tiles=TILES))[0] for act in ("none", "gelu", "relu")]
    print(f"{M:7d} {M / 64 / 264:10.2f} {copy * 1e6:8.1f} " + " ".join(f"{t * 1e6:8.1f}" for t in times) + f"  {TILES}", flush=True)
