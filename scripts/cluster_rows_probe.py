"""Long softmax rows on thread-block clusters (cluster_planes' row geometry): each cluster size (--sizes), as many
clusters as fit (or an eighth fewer, --fewer), the next piece issued after the exchange or as soon as the piece is
in registers (the source as generated, and the other way), and float32 exponentials exact (expf) or as Triton's
tl.exp lowers them (__expf: ex2.approx of x·log2 e). Kernel µs with a clean L2 flush before each call, beside a
copy of the same bytes.

    PYTHONPATH=. python scripts/cluster_rows_probe.py [--rows 2048] [--length 65536] [--sizes 4,8] [--fewer]

Session 37, H200 (copy of the same 512 MB 255.0 µs): clusters of 4 x 16384 (62 fit) 301.6-303.0 µs with expf
issuing late, 298.2 early, 294.8 / 291.6 with __expf; clusters of 8 (30 fit, 45 with __expf) 337 / 290.4 late,
295.3 early; 55 or 61 clusters of 4 303-325 (fewer SMs hold less bandwidth: rounds balanced by launching fewer
clusters lose); clusters of 2 (66, one CTA an SM) 387-393, of 16 (28) 419-423.
"""

import argparse
import statistics
import tempfile

import torch

import stitchflow
from stitchflow.bench.stitching_patterns import PATTERNS
from stitchflow.targets.gpu import cluster_planes
from stitchflow.targets.gpu.emit import contiguous_strides
from stitchflow.targets.gpu.timing import timed_median

ISSUE_LATE = "      if (c + nclusters < C) issue(c + nclusters);\n"
ISSUE_EARLY = "    if (tid == 0 && c + nclusters < C) issue(c + nclusters);\n"
FENCE = '    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");\n'


def variant(source: str, issue: str, exp: str) -> str:
    """The source with the next piece's copies issued `issue` ("late": after the exchange's push; "early": right
    after the piece left shared memory) and exponentials `exp` ("exact" expf, "fast" __expf)."""
    source = source.replace(ISSUE_LATE, "").replace(FENCE + ISSUE_EARLY, FENCE)
    if issue == "late":
        source = source.replace("      for (int r = 0; r < CL; ++r) push(mapa(laddr, r), sa, sb, mapa(lbar, r));\n",
                                "      for (int r = 0; r < CL; ++r) push(mapa(laddr, r), sa, sb, mapa(lbar, r));\n"
                                + ISSUE_LATE)
    else:
        source = source.replace(FENCE, FENCE + ISSUE_EARLY)
    return source.replace("__expf(", "expf(").replace("expf(", "__expf(") if exp == "fast" else \
        source.replace("__expf(", "expf(")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--length", type=int, default=65536)
    ap.add_argument("--sizes", default="4,8,2,16")
    ap.add_argument("--fewer", action="store_true")
    args = ap.parse_args()
    module = PATTERNS["softmax_long_rows"].module()
    shape = (args.rows, args.length)
    prog = stitchflow.compile(module, [torch.randn(shape)], target="gpu", fusion="full")
    (k,) = [k for run in prog._compiled for k in run.kernels]
    strides = {t: contiguous_strides(k.graph.type_of[t].shape) for t in k.inputs}
    plans, _ = cluster_planes.cluster_plans(k.graph, k.plans[0], strides)
    x = torch.randn(shape, device="cuda")
    ref = module(x)
    out = torch.empty_like(x)
    nbytes = 2 * x.numel() * 4
    copy_us = statistics.median(timed_median(lambda: out.copy_(x)) for _ in range(3)) * 1e6
    print(f"{torch.cuda.get_device_name()}: copy of the same bytes {copy_us:.1f} us "
          f"({nbytes / copy_us / 1e6:.2f} TB/s)")
    cache = tempfile.mkdtemp(prefix="stitchflow-probe-")
    sizes = [int(s) for s in args.sizes.split(",")]
    for index, cp in enumerate(plans):
        if cp.cluster not in sizes:
            continue
        for issue in ("late", "early"):
            for exp in ("exact", "fast"):
                launch = cluster_planes.ClusterLaunch(k.graph, k.plans[0], plans, index, "probe", cache)
                launch.cuda = variant(launch.cuda, issue, exp)
                launch.ext = cluster_planes.load(launch.cuda, launch.glue, cache)
                stream = torch.cuda.current_stream().cuda_stream
                fits = launch.ext.run([torch.empty(0, device="cuda")], ~index, 0, stream)
                for count in sorted({fits, fits - fits // 8} if args.fewer else {fits}):
                    launch.clusters[x.device] = count
                    env = {k.inputs[0]: x}
                    launch(env)
                    err = (env[cp.outputs[0]] - ref).abs().max().item()
                    us = [timed_median(lambda: launch({k.inputs[0]: x})) * 1e6 for _ in range(5)]
                    print(f"cluster {cp.cluster:2d} x {cp.plane:6d}, issue {issue:5s}, exp {exp:5s}, {count:3d} of "
                          f"{fits:3d} clusters: {statistics.median(us):7.1f} us "
                          f"({' / '.join(f'{u:.1f}' for u in us)}), {copy_us / statistics.median(us):.1%} of the copy, "
                          f"max error {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
