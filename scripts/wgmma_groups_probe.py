"""Device probe: the grouped wgmma chain kernel (2-4 warpgroups per program, each walking its own row tiles against
one shared copy of the weights) against the two-programs-per-SM kernel, eager and torch.compile, on the memory-bound
chain 65536x64->256->64 (error against an fp32 reference, CUDA-graph medians after a clean L2 flush).
Not a test: prints a table."""
import time

import torch
import torch.nn.functional as F

from stitchflow.targets.gpu.chain_wgmma import WgmmaTiles, chain_wgmma
from stitchflow.targets.gpu.timing import graph_bench

VARIANTS = [WgmmaTiles(64, 128, 4, 2, 2, 2), WgmmaTiles(64, 64, 4, 2, 2, 2), WgmmaTiles(64, 128, 4, 3, 2, 2)]


def main(M=65536, K=64, N=256, L=64):
    torch.manual_seed(0)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(K, N, device="cuda") / K ** 0.5).to(torch.bfloat16)
    d = (torch.randn(N, L, device="cuda") / N ** 0.5).to(torch.bfloat16)
    comp = torch.compile(lambda a, b, d: F.gelu(a @ b) @ d)
    rows = [("eager", graph_bench(lambda: F.gelu(a @ b) @ d)[0]), ("torch.compile", graph_bench(lambda: comp(a, b, d))[0])]
    for t in VARIANTS:
        for act in ("gelu", "none"):
            try:
                out = chain_wgmma(a, b, d, act=act, tiles=t)
                fn = (lambda v: v) if act == "none" else F.gelu
                want = fn(a.float() @ b.float()).to(torch.bfloat16).float() @ d.float()
                err = ((out.float() - want).abs().max() / want.abs().max()).item()
                rows.append((f"{t} {act} err={err:.1e}", graph_bench(lambda: chain_wgmma(a, b, d, act=act, tiles=t))[0]))
            except Exception as e:  # report and go on: a probe
                rows.append((f"{t} {act} FAILED {type(e).__name__}: {str(e)[:300]}", float("nan")))
            print(f"{rows[-1][1] * 1e6:8.1f} us  {rows[-1][0]}", flush=True)
    base = min(rows[0][1], rows[1][1])
    print(f"\n## {M}x{K}-{N}-{L}  ({torch.cuda.get_device_name()})")
    for label, s in rows:
        print(f"{s * 1e6:8.1f} us  {base / s:5.2f}x  {label}", flush=True)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"probe took {time.time() - t0:.0f} s")
