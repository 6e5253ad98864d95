"""Device probe: where does column_standardize lose its 5-6 µs to column_center? Both generated kernels at the
bench's config (65536x1024 fp32, pieces of 32x1024, two groups of 64 persistent programs), each edited to stamp
%globaltimer at five points of every block: the top of the loop, the piece landed (after the mbarrier wait), the
arrival, the barrier's release (after the spin) and the stores issued (the end of the body). Prints the mean of each
phase over programs and blocks, and the kernel time with and without the stamps. Not a test.

    PYTHONPATH=.:scripts python3 scripts/column_timeline_probe.py
"""
from __future__ import annotations

import re
import statistics

import torch

from column_tma_store_probe import launcher
from column_wide_probe import generated_column
from stitchflow.targets.gpu.timing import timed_median

BLOCKS = 16  # column blocks per group: 32 blocks of 32 columns over two groups
SPIN = re.compile(r"            arrived = gl.atomic_add\(buf\d+_rows_arrived \+ pid_p, 0, "
                  r"sem='acquire', scope='gpu'\)\n")
POINTS = ("top", "landed", "arrived", "released", "stored")
STAMP = ('gl.store(stamps + ((pid * {blocks} + it) * {points} + {k}), gl.inline_asm_elementwise('
         '"mov.u64 $0, %globaltimer;", "=l,r", [{dep}], dtype=gl.int64, is_pure=False, pack=1))')


def stamped(src: str) -> str:
    """The generated source with a `stamps` argument and a stamp at each of POINTS."""
    def at(k: int, dep: str, indent: str = "        ") -> str:
        return indent + STAMP.format(blocks=BLOCKS, points=len(POINTS), k=k, dep=dep) + "\n"

    spin = SPIN.search(src)
    assert spin, "the generated kernel changed: no acquiring poll"
    edits = [
        ("        mbarrier.wait(bar, it & 1)\n", at(0, "pid") + "        mbarrier.wait(bar, it & 1)\n" + at(1, "pid")),
        ("        arrived += 1\n", "        arrived += 1\n" + at(2, "arrived")),
        (spin.group(0), spin.group(0) + at(3, "arrived")),
        ("        it += 1\n", at(4, "pid") + "        it += 1\n"),
        ("desc0, PHASE: gl.constexpr):", "desc0, stamps, PHASE: gl.constexpr):"),
        ("desc0, PHASE)", "desc0, stamps, PHASE)"),
    ]
    for old, new in edits:
        assert old in src, f"the generated kernel changed: {old.strip()!r} not found"
        src = src.replace(old, new)
    return src


def main():
    for name in ("column_center", "column_standardize"):
        k, spec, _ = generated_column(name)
        assert spec.grid == 128
        stamps = torch.zeros(spec.grid * BLOCKS * len(POINTS), dtype=torch.int64, device="cuda")
        run_plain, _ = launcher(name, spec.source)
        run_timed, check = launcher(name, stamped(spec.source), extra=(stamps,))
        print(f"{name}: relative error {check():.1e}; kernel {timed_median(run_plain) * 1e6:.1f} us, "
              f"with stamps {timed_median(run_timed) * 1e6:.1f} us", flush=True)
        run_timed()
        torch.cuda.synchronize()
        t = stamps.view(spec.grid, BLOCKS, len(POINTS)).double() / 1e3  # µs
        phases = {f"{POINTS[i]} -> {POINTS[i + 1]}": (t[:, :, i + 1] - t[:, :, i]) for i in range(len(POINTS) - 1)}
        phases["stored -> next top"] = t[:, 1:, 0] - t[:, :-1, 4]
        for label, d in phases.items():
            d = d.flatten().tolist()
            print(f"  {label:22s} mean {statistics.mean(d):6.2f}  median {statistics.median(d):6.2f}  "
                  f"max {max(d):6.2f} us", flush=True)
        span = (t[:, -1, 4].max() - t[:, 0, 0].min()).item()
        print(f"  first top -> last store {span:.1f} us, {span / BLOCKS:.2f} us per block", flush=True)


if __name__ == "__main__":
    main()
