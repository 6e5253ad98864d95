"""Device probe (run under ncu): the TMA-fed cooperative kernels of batch norm and column_center, pinned to their
chosen configs, and a torch copy of each one's bytes, so that ncu can compare their DRAM traffic and throughput:

    ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
        -k regex:"sf_|copy|elementwise" python scripts/ncu_stitch_dram.py

Not a test."""
import torch

import stitchflow
from stitchflow.bench.stitching_patterns import PATTERNS

PINNED = {
    "batchnorm_train": dict(block_p=1, block_l=32768, split=8, num_warps=8, persistent=128),
    "column_center": dict(block_p=32, block_l=1024, split=64, num_warps=8, persistent=128),
}

for name, pinned in PINNED.items():
    pattern = PATTERNS[name]
    args = pattern.make(pattern.large, pattern.dtype, "cuda", torch.Generator().manual_seed(0))
    options = {**pinned, "coop": True, "tma": True, "cuda_graphs": False}
    prog = stitchflow.compile(pattern.module(), args, target="gpu", fusion="full", options=options)
    for _ in range(2):
        prog(*args)
    x = args[0] if isinstance(args, tuple) else args
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
