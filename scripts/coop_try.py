"""Device probe: stitching patterns at the bench's shapes under pinned cooperative splits, persistent or not
(µs and error against eager). Not a test: prints a line per config."""
import traceback

import torch

import stitchflow
from stitchflow.bench.stitching_patterns import PATTERNS
from triton.testing import do_bench

CONFIGS = [("batchnorm_train", (1, 8192, 25, 8, 0)), ("column_standardize", (32, 1024, 64, 8, 0))]
for name, cfg in CONFIGS:
    pattern = PATTERNS[name]
    args = pattern.make(pattern.large, pattern.dtype, "cuda", torch.Generator().manual_seed(0))
    bp, bl, split, warps, pers = cfg
    options = {"block_p": bp, "block_l": bl, "split": split, "num_warps": warps, "coop": True, "persistent": pers,
               "cuda_graphs": False}
    try:
        prog = stitchflow.compile(pattern.module(), args, target="gpu", fusion="full", options=options)
        out = prog(*args); ref = pattern.module()(*args)
        o = out[0] if isinstance(out, tuple) else out; r = ref[0] if isinstance(ref, tuple) else ref
        err = ((o.float() - r.float()).norm() / r.float().norm()).item()
        t = do_bench(lambda: prog(*args), warmup=5, rep=50, return_mode="median") * 1e3
        print(f"{name} {cfg}: {t:.1f} us err {err:.1e}", flush=True)
    except Exception as e:
        print(f"{name} {cfg}: FAIL {type(e).__name__}: {str(e)[:1500]}", flush=True)
        traceback.print_exc(limit=3)
