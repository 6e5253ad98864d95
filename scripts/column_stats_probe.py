"""Device probe: what shortens a block of the column patterns' generated kernels? Edits the generated Gluon kernel
of column_center and column_standardize (65536x1024 fp32, the autotuner's config) and times every variant with the
clean flush in three rounds in turn, beside a copy of the same bytes.

    python scripts/column_stats_probe.py [--hints] [pattern ...]

Variants: standardize's piece statistics as each thread's own two-pass mean and centred sum of squares over its 32
rows, combined across the row lanes by one reduction of (mean, sum, count) triples (Chan), instead of the piece's
mean reduced across the warps first and the centred squares reduced after it; with --hints, cache hints on the
stores (evict_first, .cs), the partials kept in L2 (evict_last), and a spin backed off by nanosleep.

Not a test."""
import dataclasses
import re
import sys

import torch

from stitchflow.bench.stitching_patterns import PATTERNS, pattern_kernel
from stitchflow.targets.gpu.codegen import build_kernel
from stitchflow.targets.gpu.mapping import Config
from stitchflow.targets.gpu.runtime import Launch
from stitchflow.targets.gpu.timing import timed_median

SHAPE = (65536, 1024)
CONFIG = Config(32, 1024, 64, 8, persistent=128, coop=True, tma=True)

SLEEP = '''

@gluon.jit
def _nanosleep():
    gl.inline_asm_elementwise("nanosleep.u32 NS; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

'''


def _with_store_hint(src: str, hint: str) -> str | None:
    m = re.search(r"gl\.store\((out0 \+ [^\n]*)\)\n", src)
    return src.replace(m.group(0), f"gl.store({m.group(1)}, {hint})\n", 1) if m else None


def _with_partials_kept(src: str) -> str:
    return re.sub(r"gl\.store\((buf\d\w* \+ pid_s \* \d+ \+ p, r\d+)\)", r"gl.store(\1, eviction_policy='evict_last')",
                  src)


def _with_sleep(src: str, ns: int) -> str | None:
    m = re.search(r"\n(\s+)(arrived = gl\.atomic_add\(\w+ \+ pid_p, 0, sem='acquire', scope='gpu'\))\n", src)
    if not m:
        return None
    out = src.replace(m.group(0), f"\n{m.group(1)}_nanosleep()\n{m.group(1)}{m.group(2)}\n", 1)
    return out.replace("\n@gluon.jit\ndef _part0", SLEEP.replace("NS", str(ns)) + "@gluon.jit\ndef _part0", 1)


CHAN = '''

@gluon.jit
def _chan(ma, qa, na, mb, qb, nb):
    """Chan, Golub and LeVeque's combine of two (mean, centred sum of squares, count) groups."""
    n = na + nb
    d = mb - ma
    w = nb / n
    return ma + d * w, qa + qb + d * d * (na * w), n

'''


def _with_lane_statistics(src: str) -> str | None:
    """The piece's statistics from each thread's own rows first: the [32, 1024] tile seen as [32, 32, 32] (columns,
    a thread's rows, the 32 row lanes of 4 threads x 8 warps), each lane's mean and centred sum of squares in
    registers, then one cross-lane reduction of the triples."""
    m = re.search(r"\n(\s+)(x\d+) = cur2\n(?:.*\n)*?\s+gl\.store\((buf1 \+ pid_s \* 1024 \+ p), (r\d+)\)\n", src)
    mean = re.search(r"gl\.store\((buf0 \+ pid_s \* 1024 \+ p), (r\d+)\)", m.group(0)) if m else None
    if not (m and mean):
        return None
    ind, x = m.group(1), m.group(2)
    body = [f"{x} = cur2",
            f"xr = gl.reshape({x}, [32, 32, 32])",
            "m_t = gl.sum(xr, axis=1) * (1.0 / 32)",
            "dd = xr - gl.expand_dims(m_t, 1)",
            "q_t = gl.sum(dd * dd, axis=1)",
            "mu_p, q_p, n_p = gl.reduce((m_t, q_t, m_t * 0.0 + 32.0), 1, _chan)",
            f"{mean.group(2)} = gl.expand_dims(gl.convert_layout(mu_p, gl.SliceLayout(1, LAYOUT)), 1) * (1024 / 65536)",
            f"gl.store({mean.group(1)}, {mean.group(2)})",
            f"{m.group(4)} = gl.expand_dims(gl.convert_layout(q_p, gl.SliceLayout(1, LAYOUT)), 1) * (1.0 / 65536)",
            f"gl.store({m.group(3)}, {m.group(4)})"]
    out = src.replace(m.group(0), "\n" + "".join(f"{ind}{line}\n" for line in body), 1)
    return out.replace("\n@gluon.jit\ndef _part0", CHAN + "@gluon.jit\ndef _part0", 1)


def _with_fma_output(src: str | None) -> str | None:
    """(x - mean) * rstd as x * rstd - mean * rstd: one FMA an element."""
    o = re.search(r"\n(\s+)t(\d+) = \((x\d+) - (v\d+)\)\n\s+v\d+ = t\d+\.to\(gl\.float32\)\n"
                  r"\s+t(\d+) = \(v\d+ \* (v\d+)\)\n", src or "")
    if not o:
        return None
    ind, x, mean, result, rstd = o.group(1), o.group(3), o.group(4), o.group(5), o.group(6)
    return src.replace(o.group(0), f"\n{ind}t{result} = {x} * {rstd} + ({mean} * -{rstd})\n", 1)


def variants(src: str, hints: bool) -> dict:
    out = {"generated": src,
           "lane statistics": _with_lane_statistics(src),
           "FMA output": _with_fma_output(src),
           "lane statistics, FMA output": _with_fma_output(_with_lane_statistics(src))}
    if not hints:
        return {label: s for label, s in out.items() if s is not None}
    out |= {
        "stores evict_first": _with_store_hint(src, "eviction_policy='evict_first'"),
        "stores .cs": _with_store_hint(src, "cache_modifier='.cs'"),
        "stores evict_first, partials evict_last": _with_store_hint(_with_partials_kept(src),
                                                                    "eviction_policy='evict_first'"),
        "partials evict_last": _with_partials_kept(src),
        "spin backs off 100 ns": _with_sleep(src, 100),
        "spin backs off 400 ns": _with_sleep(src, 400),
    }
    return {label: s for label, s in out.items() if s is not None}


def main():
    hints = "--hints" in sys.argv
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or ["column_center", "column_standardize"]
    launches, envs, refs = {}, {}, {}
    for name in names:
        k, strides = pattern_kernel(name, SHAPE)
        spec = build_kernel(k.graph, [(k.plans[0], CONFIG)], strides, False, k.title, k.group_names)
        args = PATTERNS[name].make(SHAPE, torch.float32, "cuda", torch.Generator().manual_seed(0))
        env = dict(zip(k.inputs, args if isinstance(args, tuple) else (args,)))
        ref = PATTERNS[name].module()(*env.values())
        for label, src in variants(spec.source, hints).items():
            launch = Launch(k.graph, dataclasses.replace(spec, source=src), f"{name}:{label}")
            launch(env)
            err = (env[spec.outputs[0]] - ref).abs().max().item()
            launches[f"{name} {label} (max error {err:.1e})"] = (launch, env)
    x = torch.randn(SHAPE, device="cuda")
    y = torch.empty_like(x)
    launches["copy of the same bytes"] = (lambda env: y.copy_(x), None)
    times = {label: [] for label in launches}
    for _ in range(3):
        for label, (launch, env) in launches.items():
            times[label].append(timed_median(lambda: launch(env), budget_s=0.3) * 1e6)
    for label, ts in times.items():
        print(f"{label}: " + " / ".join(f"{t:.1f}" for t in ts) + " us", flush=True)


if __name__ == "__main__":
    main()
