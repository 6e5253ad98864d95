"""Run one stitching pattern under a pinned cooperative split a few times (for ncu):
python scripts/coop_ncu.py column_standardize 32 1024 64 16"""
import sys

import torch

import stitchflow
from stitchflow.bench.stitching_patterns import PATTERNS

name = sys.argv[1] if len(sys.argv) > 1 else "column_standardize"
bp, bl, split, warps = (int(x) for x in (sys.argv[2:6] or (32, 1024, 64, 16)))
pattern = PATTERNS[name]
args = pattern.make(pattern.large, pattern.dtype, "cuda", torch.Generator().manual_seed(0))
options = {"block_p": bp, "block_l": bl, "split": split, "num_warps": warps, "coop": True, "cuda_graphs": False}
prog = stitchflow.compile(pattern.module(), args, target="gpu", fusion="full", options=options)
for _ in range(3):
    prog(*args)
torch.cuda.synchronize()
