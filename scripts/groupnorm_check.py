"""Device check: group norm + SiLU in bfloat16 with a mean far from the spread, each path against float64.

    python scripts/groupnorm_check.py

Not a test: prints the relative error of eager (CUDA and CPU) and of stitchflow's paths (chunk loop with the
variance riding the mean, one chunk, cluster planes) against a float64 reference."""
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


if __name__ == "__main__":
    main()
