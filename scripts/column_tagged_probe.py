"""Device probe: the column kernels' barrier without a fence. In the generated kernels (65536x1024 fp32, pieces of
32x1024, two groups of 64 persistent programs) a program publishes its piece's partial statistics with an acq_rel
arrival, whose fence waits for the previous block's 128 KB of output stores to drain and for any copy in flight
(so the next piece's copies are issued after it: scripts/column_timeline_probe.py). Here each partial carries the
launch's number in the high half of one 64-bit word (one relaxed atomic exchange writes both), the arrival count is
relaxed and only a hint for the spin, and a reader takes the partials once every word holds this launch's number:
nothing waits for the stores, and the next piece's copies may leave as soon as the piece is in registers.

Variants per pattern: generated; tagged (copies after the arrival, as generated); tagged with the copies issued
right after the piece moved to registers. Each checked against eager over several launches (the tags of earlier
launches must not be taken), then timed in rounds. Not a test.

    PYTHONPATH=.:scripts python3 scripts/column_tagged_probe.py
"""
from __future__ import annotations

import re

import torch

from column_tma_store_probe import time_rounds
from column_wide_probe import generated_column
from stitchflow.bench.stitching_patterns import PATTERNS
from stitchflow.targets.gpu.runtime import load_source, tma_descriptor

PARTIAL_STORE = re.compile(r"        gl.store\((buf\d+) \+ pid_s \* 1024 \+ p, (r\d+)\)\n")
PARTIAL_LOAD = re.compile(r"        (parts\d+) = gl.load\((buf\d+) \+ (s\d+|0) \* 1024 \+ p, cache_modifier='.cg'\)\n")
REFILL = re.compile(r"        if pid_p \+ 2 < 32:\n(?:            [^\n]*\n)+")
MOVED = "        fence_async_shared()\n        x3 = cur2\n"
TAGGED_STORE = ("        gl.atomic_xchg({buf} + pid_s * 1024 + p, (launch_no << 32) | "
                "({value}.to(gl.int32, bitcast=True).to(gl.int64) & 0xFFFFFFFF), sem='relaxed', scope='gpu')\n")
# every word of the [32, 64] tile must carry this launch's number; re-read until it does
TAGGED_LOAD = """        w_{parts} = gl.load({buf} + {rows} * 1024 + p, volatile=True)
        stale_{parts} = gl.sum(gl.sum(((w_{parts} >> 32) != launch_no).to(gl.int32), axis=1), axis=0)
        while stale_{parts} > 0:
            w_{parts} = gl.load({buf} + {rows} * 1024 + p, volatile=True)
            stale_{parts} = gl.sum(gl.sum(((w_{parts} >> 32) != launch_no).to(gl.int32), axis=1), axis=0)
        {parts} = (w_{parts} & 0xFFFFFFFF).to(gl.int32).to(gl.float32, bitcast=True)
"""


def tagged(src: str, early_copies: bool) -> str:
    """`src` with tagged partials and a relaxed arrival; with early_copies, the next piece's copies issued as soon
    as the piece is in registers."""
    stores, loads = PARTIAL_STORE.findall(src), PARTIAL_LOAD.findall(src)
    assert stores and loads, "the generated partials changed: update the probe"
    for buf, value in stores:
        src = src.replace(f"        gl.store({buf} + pid_s * 1024 + p, {value})\n",
                          TAGGED_STORE.format(buf=buf, value=value))
    for parts, buf, rows in loads:
        old = f"        {parts} = gl.load({buf} + {rows} * 1024 + p, cache_modifier='.cg')\n"
        src = src.replace(old, TAGGED_LOAD.format(parts=parts, buf=buf, rows=rows))
    edits = [
        ("sem='acq_rel', scope='gpu')", "sem='relaxed', scope='gpu')"),
        ("sem='acquire', scope='gpu')", "sem='relaxed', scope='gpu')"),
        ("    it = 0\n", "    it = 0\n    launch_no = gl.atomic_add(launches + pid, 1, sem='relaxed', scope='gpu') + 1\n"),
        ("desc0, PHASE: gl.constexpr):", "desc0, launches, PHASE: gl.constexpr):"),
        ("desc0, PHASE)", "desc0, launches, PHASE)"),
    ]
    if early_copies:
        refill = REFILL.search(src)
        assert refill and MOVED in src, "the generated refill changed: update the probe"
        src = src.replace(refill.group(0), "")
        edits.append((MOVED, MOVED.replace("        x3", refill.group(0) + "        x3")))
    for old, new in edits:
        assert old in src, f"the generated kernel changed: {old.strip()!r} not found"
        src = src.replace(old, new)
    return src


def launcher(name: str, source: str, is_tagged: bool):
    """(run, check): `source` launched directly on the probe's input with fresh zeroed scratch; a tagged kernel's
    partial buffers are int64 words, and it takes a launch counter per program."""
    k, spec, env = generated_column(name)
    (_, box, view), = spec.tma
    x = env[k.inputs[0]]
    out = torch.empty_like(x)
    bufs = [torch.zeros(n, dtype=torch.int64 if is_tagged else dt, device="cuda") for _, n, dt in spec.buffers]
    args = [x, out] + bufs + [tma_descriptor(x, box, view)]
    args += [torch.zeros(spec.grid, dtype=torch.int64, device="cuda")] if is_tagged else []
    kernel = load_source(source).kernel

    def run():
        kernel[(spec.grid,)](*args, PHASE=0, num_warps=spec.num_warps)

    def check() -> float:
        ref = PATTERNS[name].module()(x)
        worst = 0.0
        for seed in range(4):  # fresh inputs each launch: a stale partial would show
            x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x.device) * (seed + 1))
            ref = PATTERNS[name].module()(x)
            run()
            worst = max(worst, ((out - ref).norm() / ref.norm()).item())
        return worst
    return run, check


def main():
    runs = {}
    for name in ("column_center", "column_standardize"):
        source = generated_column(name)[1].source
        for label, src, is_tagged in (("generated", source, False),
                                      ("tagged", tagged(source, False), True),
                                      ("tagged, early copies", tagged(source, True), True)):
            run, check = launcher(name, src, is_tagged)
            print(f"{name} {label}: worst relative error over 4 launches {check():.1e}", flush=True)
            runs[f"{name} {label}"] = run
    time_rounds(runs)


if __name__ == "__main__":
    main()
