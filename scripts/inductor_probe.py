"""Device probe: what torch.compile (default mode) runs for gelu(a @ b) @ d at the GPT-6.7B FFN's
prefill sizes, and how long its parts take against cuBLAS + our act pass."""
import os
import sys

import torch
import torch.nn.functional as F

from stitchflow.targets.gpu import chain_kernels as ck
from stitchflow.targets.gpu.timing import graph_bench

M = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
a = torch.randn(M, 4096, device="cuda").bfloat16()
b = (torch.randn(4096, 16384, device="cuda") / 64).bfloat16()
d = (torch.randn(16384, 4096, device="cuda") / 128).bfloat16()
fn = torch.compile(lambda a, b, d: F.gelu(a @ b) @ d)
fn(a, b, d)
g = a @ b
rows = {"compiled chain": lambda: fn(a, b, d), "eager chain": lambda: F.gelu(a @ b) @ d, "cuBLAS a@b": lambda: a @ b,
        "cuBLAS h@d": lambda: g @ d, "F.gelu(g)": lambda: F.gelu(g), "our act pass": lambda: ck.act_pass(g, "gelu"),
        "addmm_activation gelu": lambda: torch._addmm_activation(torch.zeros(16384, device="cuda").bfloat16(), a, b,
                                                                 use_gelu=True)}
for name, f in rows.items():
    print(f"{graph_bench(f)[0] * 1e6:8.1f} us  {name}", flush=True)
