"""Run one chain kernel a few times (for ncu): python scripts/wgmma_ncu.py [act] [bm bn a_stages programs_per_sm]"""
import sys

import torch

from stitchflow.targets.gpu.chain_wgmma import WgmmaTiles, chain_wgmma

act = sys.argv[1] if len(sys.argv) > 1 else "gelu"
bm, bn, stages, per_sm = (int(x) for x in (sys.argv[2:6] or (64, 128, 2, 2)))
a = torch.randn(65536, 64, device="cuda", dtype=torch.bfloat16)
b = (torch.randn(64, 256, device="cuda") / 8).to(torch.bfloat16)
d = (torch.randn(256, 64, device="cuda") / 16).to(torch.bfloat16)
tiles = WgmmaTiles(bm, bn, 4 if bm == 64 else 8, stages, 2, per_sm)
for _ in range(3):
    chain_wgmma(a, b, d, act=act, tiles=tiles)
torch.cuda.synchronize()
