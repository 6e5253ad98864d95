"""Device probe: which generated kernel of a model's training step differs from the reference interpreter? Runs
one step under torch.compile(backend="stitchflow", options={"check_kernels": True}) without CUDA graphs and prints
the first KernelMismatch with the kernel's source (how the Triton miscompile of scripts/triton_div_probe.py was
found). Not a test.

    python scripts/kernel_check_probe.py [maxpool_ceil | llama]
"""
import sys

import torch
from torch import nn

import stitchflow.backend  # noqa: F401  (registers the backend)
from stitchflow.bench.training import training_case
from stitchflow.ir.errors import KernelMismatch


def maxpool_ceil():
    model = nn.Sequential(nn.Linear(7, 7), nn.MaxPool2d(2, ceil_mode=True)).cuda()
    return model, (torch.randn(2, 3, 8, 7, device="cuda"),), None


CASES = {"maxpool_ceil": maxpool_ceil,
         "llama": lambda: training_case("llama", torch.bfloat16, "small", "cuda", 0)}


def main():
    torch.manual_seed(0)
    model, inputs, upstream = CASES[sys.argv[1] if len(sys.argv) > 1 else "maxpool_ceil"]()
    fn = torch.compile(model, backend="stitchflow", options={"target": "gpu", "training": "compiled",
                                                              "cuda_graphs": False, "check_kernels": True})
    try:
        out = fn(*inputs)
        out.backward(upstream if upstream is not None else torch.ones_like(out))
        torch.cuda.synchronize()
        print("every generated kernel equals the reference interpreter")
    except KernelMismatch as mismatch:
        print(mismatch)
        print(mismatch.source[mismatch.source.index("def _part0"):])


if __name__ == "__main__":
    main()
