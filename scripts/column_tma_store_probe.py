"""Device probe: the column kernels' outputs through TMA stores. In the generated kernels (65536x1024 fp32, pieces
of 32x1024, two groups of 64 persistent programs) each block's 128 KB of outputs leave as st.global from registers,
and the next block's arrival (an acq_rel atomic: a fence) waits until they have drained, most of the 2.9 µs from
the piece landing to the arrival (scripts/column_timeline_probe.py). Here the outputs go out instead as bulk
tensor copies from a 64 KB staging buffer, in two halves of 512 rows: a copy of the async proxy, which the
arrival's fence need not wait for. Prints each kernel's time, generated and edited, in rounds, and the timeline of
the edited ones. Not a test.

    PYTHONPATH=.:scripts python3 scripts/column_tma_store_probe.py
"""
from __future__ import annotations

import re
import statistics

import torch

from column_wide_probe import generated_column
from stitchflow.bench.stitching_patterns import PATTERNS
from stitchflow.targets.gpu.runtime import load_source, tma_descriptor
from stitchflow.targets.gpu.timing import timed_median

OUTPUT_STORE = re.compile(r"        gl.store\((out0) \+ c\d+ \* 1024 \+ c1, (v\d+)\.to\(gl.float32\)\)\n")
STAGED = """        lo_half, hi_half = gl.split(gl.permute(gl.reshape({value}, [32, 2, 512]), (0, 2, 1)))
        tma.store_wait(0)
        gl.thread_barrier()  # the last block's second half has left the staging buffer
        stage.permute((1, 0)).store(lo_half)
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(desc_out, [lo, pid_p * 32], stage.slice(0, 256))
        tma.async_copy_shared_to_global(desc_out, [lo + 256, pid_p * 32], stage.slice(256, 256))
        tma.store_wait(0)
        gl.thread_barrier()
        stage.permute((1, 0)).store(hi_half)
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(desc_out, [lo + 512, pid_p * 32], stage.slice(0, 256))
        tma.async_copy_shared_to_global(desc_out, [lo + 768, pid_p * 32], stage.slice(256, 256))
"""


def tma_stored(src: str) -> str:
    store = OUTPUT_STORE.search(src)
    assert store, "the generated output store changed: update the probe"
    edits = [
        (store.group(0), STAGED.format(value=store.group(2))),
        ("    mbarrier.init(bar, count=1)\n",
         "    stage = gl.allocate_shared_memory(desc_out.dtype, [512, 32], desc_out.layout)\n"
         "    mbarrier.init(bar, count=1)\n"),
        ("    mbarrier.invalidate(bar)\n", "    tma.store_wait(0)\n    mbarrier.invalidate(bar)\n"),
        ("desc0, PHASE: gl.constexpr):", "desc0, desc_out, PHASE: gl.constexpr):"),
        ("desc0, PHASE)", "desc0, desc_out, PHASE)"),
    ]
    for old, new in edits:
        assert old in src, f"the generated kernel changed: {old.strip()!r} not found"
        src = src.replace(old, new)
    return src


def launcher(name: str, source: str, out_descriptor: bool = False, extra: tuple = ()):
    """(run, check) for `source`, an edit of the generated kernel of `name` at the bench's config: run launches it
    directly on the probe's input (with out_descriptor, a TMA descriptor of the output after the input's; then the
    `extra` arguments); check returns its relative error against eager."""
    k, spec, env = generated_column(name)
    (_, box, view), = spec.tma
    x = env[k.inputs[0]]
    out = torch.empty_like(x)
    bufs = [torch.zeros(n, dtype=dt, device="cuda") for _, n, dt in spec.buffers]
    args = [x, out] + bufs + [tma_descriptor(x, box, view)]
    args += ([tma_descriptor(out, box, view)] if out_descriptor else []) + list(extra)
    kernel = load_source(source).kernel

    def run():
        kernel[(spec.grid,)](*args, PHASE=0, num_warps=spec.num_warps)

    def check() -> float:
        run()
        ref = PATTERNS[name].module()(x)
        return ((out - ref).norm() / ref.norm()).item()
    return run, check


def time_rounds(runs: dict, rounds: int = 3) -> None:
    """Each run's clean-flush median, `rounds` times over with the runs in turn; prints the medians."""
    times = {key: [] for key in runs}
    for _ in range(rounds):
        for key, run in runs.items():
            times[key].append(timed_median(run, budget_s=0.1) * 1e6)
    for key, ts in times.items():
        print(f"{key}: {statistics.median(ts):.1f} us (rounds {', '.join(f'{t:.1f}' for t in ts)})", flush=True)


def main():
    runs = {}
    for name in ("column_center", "column_standardize"):
        source = generated_column(name)[1].source
        for label, src, extra in (("generated", source, False), ("TMA stores", tma_stored(source), True)):
            run, check = launcher(name, src, extra)
            print(f"{name} {label}: relative error {check():.1e}", flush=True)
            runs[f"{name} {label}"] = run
    time_rounds(runs)


if __name__ == "__main__":
    main()
