"""Device probe: do the column kernels' two groups gain from running out of phase? The generated kernels
(65536x1024 fp32, pieces of 32x1024, two groups of 64 persistent programs, each group walking its own column
blocks) edited so that group 1 waits a fixed time (spinning on %globaltimer) after issuing its first piece's
copies: while one group waits at its barrier, the other would be storing. Prints each delay's kernel time, in
rounds. Not a test.

    PYTHONPATH=.:scripts python3 scripts/column_group_offset_probe.py
"""
from __future__ import annotations

from column_tma_store_probe import launcher, time_rounds
from column_wide_probe import generated_column

DELAYS_US = (0, 2, 4, 6, 8)
FIRST_COPY = "    tma.async_copy_global_to_shared(desc0, [lo + 768, (grp) * 32], bar, smem0.slice(768, 256))\n"
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
    runs = {}
    for name in ("column_center", "column_standardize"):
        source = generated_column(name)[1].source
        for us in DELAYS_US:
            run, check = launcher(name, delayed(source, us))
            assert check() < 1e-5
            runs[f"{name}, group 1 delayed {us} us"] = run
    time_rounds(runs)


if __name__ == "__main__":
    main()
