"""Device probe: the GPT-6.7B FFN at M=128 (128×4096·4096×16384 → GELU → ·16384×4096) half by half:
our Triton GEMMs (GELU epilogue on GEMM1; split-K on GEMM2) and the TMA GEMM over tiles and
pipeline depths, against cuBLAS, CUDA-graph timed. Prints µs and the fraction of the copy rate."""
import itertools

import torch
import torch.nn.functional as F

from stitchflow.targets.gpu import chain_kernels as ck
from stitchflow.targets.gpu.timing import graph_bench
from stitchflow.targets.gpu.gemm_tma import gemm_tma
from triton.testing import do_bench

src = torch.randn(1 << 28, device="cuda")
dst = torch.empty_like(src)
copy_bw = 2 * (1 << 30) / (do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median") * 1e-3)
del src, dst
print(f"copy {copy_bw / 1e12:.2f} TB/s ({torch.cuda.get_device_name()})")
M, K, N, L = 128, 4096, 16384, 4096
a = torch.randn(M, K, device="cuda").bfloat16()
b = (torch.randn(K, N, device="cuda") / 64).bfloat16()
d = (torch.randn(N, L, device="cuda") / 128).bfloat16()
h = F.gelu(a @ b)
ref1, ref2 = h.float(), (h @ d).float()


def show(label, fn, ref, nbytes):
    try:
        err = ((fn().float() - ref).norm() / ref.norm()).item()
        s = graph_bench(fn)[0]
        print(f"{s * 1e6:7.1f} us  {nbytes / s / copy_bw:5.2f} of copy  err {err:.1e}  {label}", flush=True)
    except Exception as e:
        print(f"    FAIL {label}: {type(e).__name__} {str(e)[:120]}", flush=True)


w1, w2 = K * N * 2, N * L * 2
show("G1 cuBLAS + gelu", lambda: F.gelu(a @ b), ref1, w1)
show("G1 cuBLAS alone", lambda: a @ b, (a @ b).float(), w1)
for bm, bn, bk, st in itertools.product((64, 128), (64, 128), (64, 128), (4, 5)):
    t = ck.GemmTiles(bm, bn, bk, 1, 8, 8 if bm == 128 else 4, st)
    if st * (bm * bk + bk * bn) * 2 > 220 * 1024:
        continue
    show(f"G1 triton gelu {t}", lambda t=t: ck.gemm(a, b, epi=ck.Epilogue(act="gelu"), tiles=t)[0], ref1, w1)
for bm, bn, bk, st in ((128, 128, 64, 4), (128, 128, 64, 5), (64, 128, 128, 4), (128, 64, 128, 4)):
    t = ck.GemmTiles(bm, bn, bk, 1, 8, 8 if bm * bn >= 128 * 128 else 4, st)
    show(f"G1 tma gelu {t}", lambda t=t: gemm_tma(a, b, epi=ck.Epilogue(act="gelu"), tiles=t)[0], ref1, w1)
show("G2 cuBLAS", lambda: h @ d, ref2, w2)
for bm, bn, bk, st, split in itertools.product((64,), (64, 128), (64, 128), (4, 5), (1, 2, 4)):
    t = ck.GemmTiles(bm, bn, bk, split, 8, 4 if bm * bn <= 64 * 128 else 8, st)
    if st * (bm * bk + bk * bn) * 2 > 220 * 1024:
        continue
    show(f"G2 triton {t}", lambda t=t: ck.gemm(h, d, tiles=t)[0], ref2, w2)
