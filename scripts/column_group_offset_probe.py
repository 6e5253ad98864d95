"""Device probe: do the column kernels' two groups gain from running out of phase? The generated kernels
(65536x1024 fp32, pieces of 32x1024, two groups of 64 persistent programs, each group walking its own column
blocks) edited so that group 1 waits a fixed time (spinning on %globaltimer) after issuing its first piece's
copies: while one group waits at its barrier, the other would be storing. Prints each delay's kernel time, in
rounds. Not a test.

    PYTHONPATH=. python3 scripts/column_group_offset_probe.py
"""
from __future__ import annotations

import statistics

import torch

from stitchflow.bench.stitching_patterns import PATTERNS, pattern_kernel
from stitchflow.targets.gpu.codegen import build_kernel
from stitchflow.targets.gpu.mapping import Config
from stitchflow.targets.gpu.runtime import load_source, tma_descriptor
from stitchflow.targets.gpu.timing import timed_median

R, C = 65536, 1024
DELAYS_US = (0, 2, 4, 6, 8)
FIRST_COPY = "    tma.async_copy_global_to_shared(desc0_x, [lo + 768, (grp) * 32], bar, smem0.slice(768, 256))\n"
CLOCK = 'gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [{dep}], dtype=gl.int64, is_pure=False, pack=1)'
DELAY = f"""    if grp == 1:
        start = {CLOCK.format(dep="pid")}
        now = start
        while now - start < {{ns}}:
            now = {CLOCK.format(dep="pid")}
"""


def delayed(src: str, us: float) -> str:
    assert FIRST_COPY in src, "the generated kernel changed: update the probe"
    return src.replace(FIRST_COPY, FIRST_COPY + DELAY.format(ns=int(us * 1000))) if us else src


def main():
    cfg = Config(32, 1024, 64, 8, persistent=128, coop=True, tma=True)
    x = PATTERNS["column_standardize"].make((R, C), torch.float32, "cuda", torch.Generator().manual_seed(0))
    x = x[0] if isinstance(x, tuple) else x
    runs = {}
    for name in ("column_center", "column_standardize"):
        k, strides = pattern_kernel(name, (R, C))
        spec = build_kernel(k.graph, [(k.plans[0], cfg)], strides, False, k.title, k.group_names)
        (_, box, view), = spec.tma
        ref = PATTERNS[name].module()(x)
        for us in DELAYS_US:
            out = torch.empty_like(x)
            bufs = [torch.zeros(n, dtype=dt, device="cuda") for _, n, dt in spec.buffers]
            args = [x, out] + bufs + [tma_descriptor(x, box, view)]
            kernel = load_source(delayed(spec.source, us)).kernel
            run = (lambda kernel=kernel, args=args: kernel[(spec.grid,)](*args, PHASE=0, num_warps=spec.num_warps))
            run()
            torch.cuda.synchronize()
            assert ((out - ref).norm() / ref.norm()).item() < 1e-5
            runs[f"{name}, group 1 delayed {us} us"] = run
    times = {key: [] for key in runs}
    for _ in range(3):
        for key, run in runs.items():
            times[key].append(timed_median(run, budget_s=0.1) * 1e6)
    for key, ts in times.items():
        print(f"{key}: {statistics.median(ts):.1f} us (rounds {', '.join(f'{t:.1f}' for t in ts)})", flush=True)


if __name__ == "__main__":
    main()
