"""Device probe: where a compiled program's host time goes per call, for patterns small enough that the host bounds
a loop of calls. cProfile over 200 calls of `Program.__call__` (no CUDA graphs), the top functions by own time, and
the back-to-back time per call against the kernel's do_bench time. Not a test.

    python scripts/host_profile_probe.py [pattern:rows ...]
"""
import cProfile
import io
import pstats
import sys
import time

import torch
from triton.testing import do_bench

import stitchflow
from stitchflow.bench.stitching_patterns import PATTERNS

CASES = ("add_layernorm_gelu:2048", "column_center:8192")


def main():
    for case in sys.argv[1:] or CASES:
        name, rows = case.split(":")
        pat = PATTERNS[name]
        shape = (int(rows), *pat.large[1:])
        args = pat.make(shape, pat.dtype, "cuda", torch.Generator().manual_seed(0))
        args = args if isinstance(args, tuple) else (args,)
        module = pat.module().cuda()
        with torch.no_grad():
            prog = stitchflow.compile(module, args, target="gpu", fusion="full", options={"cuda_graphs": False})
            for _ in range(3):
                prog(*args)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(200):
                prog(*args)
            torch.cuda.synchronize()
            loop = (time.perf_counter() - t) / 200 * 1e6
            bench = do_bench(lambda: prog(*args), warmup=5, rep=50, return_mode="median") * 1e3
            print(f"{name} {shape}: back to back {loop:.1f} us per call, do_bench {bench:.1f} us", flush=True)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(200):
                prog(*args)
            pr.disable()
            torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(22)
        print("\n".join(line[:160] for line in out.getvalue().splitlines()[4:40]), flush=True)


if __name__ == "__main__":
    main()
