"""Device probe: cooperative splits whose pieces are read again from L2 after each barrier, against pieces held in
registers, at the stitching bench's large shapes (µs, share of the copy-bandwidth floor, error against eager).
Not a test: prints one line per config. Usage: python scripts/coop_reread_probe.py [pattern ...]"""
import sys
import traceback

import torch
from triton.testing import do_bench

import stitchflow
from stitchflow.bench.stitching_patterns import PATTERNS

COLUMNS = [(32, 1024, 64, 16), (32, 1024, 64, 8),  # registers (the table's configs)
           (32, 512, 128, 8), (32, 512, 128, 4), (32, 256, 256, 4), (32, 256, 256, 2), (16, 1024, 64, 4),
           (32, 128, 128, 8)]  # the last: re-read from L2
CONFIGS = {
    "column_center": COLUMNS,
    "column_standardize": COLUMNS,
    "batchnorm_train": [(1, 32768, 7, 16), (1, 16384, 13, 16), (1, 8192, 25, 8), (1, 8192, 25, 16), (1, 4096, 49, 8),
                        (1, 4096, 49, 4), (1, 16384, 13, 8)],
    "softmax_long_rows": [(1, 8192, 8, 8), (1, 8192, 8, 16), (1, 4096, 16, 4)],
}


def copy_rate() -> float:
    x = torch.empty(1 << 28, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / (do_bench(lambda: y.copy_(x), warmup=5, rep=50, return_mode="median") * 1e-3)


def main(names):
    rate = copy_rate()
    print(f"copy {rate / 1e12:.2f} TB/s", flush=True)
    for name in names:
        pattern = PATTERNS[name]
        args = pattern.make(pattern.large, pattern.dtype, "cuda", torch.Generator().manual_seed(0))
        ref = pattern.module()(*args)
        ref = ref[0] if isinstance(ref, tuple) else ref
        floor_bytes = sum(a.numel() * a.element_size() for a in args if torch.is_tensor(a)) + \
            ref.numel() * ref.element_size()
        for bp, bl, split, warps in CONFIGS[name]:
            options = {"block_p": bp, "block_l": bl, "split": split, "num_warps": warps, "coop": True,
                       "cuda_graphs": False}
            try:
                prog = stitchflow.compile(pattern.module(), args, target="gpu", fusion="full", options=options)
                out = prog(*args)
                o = out[0] if isinstance(out, tuple) else out
                err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
                t = do_bench(lambda: prog(*args), warmup=5, rep=40, return_mode="median") * 1e3
                print(f"{name} {(bp, bl, split, warps)}: {t:.1f} us {floor_bytes / rate / t * 1e6:.0%} err {err:.1e}",
                      flush=True)
            except Exception as e:
                print(f"{name} {(bp, bl, split, warps)}: FAIL {type(e).__name__}: {str(e)[:300]}", flush=True)
                traceback.print_exc(limit=2)


if __name__ == "__main__":
    main(sys.argv[1:] or list(CONFIGS))
