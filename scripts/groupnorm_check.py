"""Device check: group norm + SiLU in bfloat16 with a mean far from the spread, each path against float64; with
--time, every cluster size of the bench's shape timed (kernel only).

    python scripts/groupnorm_check.py [--time]

Not a test: prints the relative error of eager (CUDA and CPU) and of stitchflow's paths (chunk loop with the
variance riding the mean, one chunk, cluster planes) against a float64 reference."""
import sys
import tempfile

import torch
import torch.nn.functional as F

import stitchflow
from stitchflow.bench.stitching_patterns import PATTERNS, relative_error


def main():
    module = PATTERNS["groupnorm_silu"].module()
    for shape, offset in (((3, 32, 5, 7), 100.0), ((2, 64, 8, 8), 100.0), ((2, 64, 8, 8), 2.0)):
        x, w, b = PATTERNS["groupnorm_silu"].make(shape, torch.bfloat16, "cuda", torch.Generator().manual_seed(0))
        x = x + offset
        ref = F.silu(F.group_norm(x.double(), 32, w.double(), b.double()))
        line = [f"{shape} +{offset}: eager cuda {relative_error(module(x, w, b), ref):.1e}",
                f"eager cpu {relative_error(module(x.cpu(), w.cpu(), b.cpu()), ref.cpu()):.1e}"]
        for label, options in (("loop32", {"block_l": 32}), ("loop32 fp32 math", {"block_l": 32}),
                               ("default", {}), ("cluster", {"cluster": True})):
            try:
                prog = stitchflow.compile(module, (x, w, b), target="gpu", fusion="full",
                                          options={**options, "cuda_graphs": False})
                line.append(f"{label} {relative_error(prog(x, w, b), ref):.1e}")
            except Exception as err:  # a path that refuses this shape says why
                line.append(f"{label}: {str(err)[:80]}")
        print("; ".join(line), flush=True)


def time_clusters(shape=(16, 512, 64, 64)):
    """Each cluster plan of the bench's shape, kernel-only medians, against eager and torch's copy."""
    from triton.testing import do_bench

    from stitchflow.bench.stitching_patterns import pattern_kernel
    from stitchflow.targets.gpu import cluster_planes

    module = PATTERNS["groupnorm_silu"].module()
    k, strides = pattern_kernel("groupnorm_silu", shape, torch.bfloat16)
    plans, why = cluster_planes.cluster_plans(k.graph, k.plans[0], strides)
    x, w, b = PATTERNS["groupnorm_silu"].make(shape, torch.bfloat16, "cuda", torch.Generator().manual_seed(0))
    ref = module(x, w, b)
    y = torch.empty_like(x)
    copy = do_bench(lambda: y.copy_(x), warmup=5, rep=100, return_mode="median")
    print(f"copy {copy * 1e3:.1f} us; eager {do_bench(lambda: module(x, w, b), return_mode='median') * 1e3:.1f} us",
          flush=True)
    cache = tempfile.mkdtemp(prefix="stitchflow-cuda-")
    for variant, cp in enumerate(plans):
        launch = cluster_planes.ClusterLaunch(k.graph, k.plans[0], plans, variant, "probe", cache)
        env = dict(zip(k.inputs, (x, w, b)))
        launch(env)
        err = relative_error(env[cp.outputs[0]].reshape(ref.shape), ref)
        us = do_bench(lambda: launch(env), warmup=10, rep=200, return_mode="median") * 1e3
        print(f"{cp}: {us:.1f} us ({copy * 1e3 / us:.0%} of copy), error {err:.1e}", flush=True)


if __name__ == "__main__":
    time_clusters() if "--time" in sys.argv else main()
