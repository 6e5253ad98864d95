"""Device probe: the Gluon weight-streaming GEMM (targets/gpu/stream_gemm.py) on the GPT-6.7B FFN
at M=128, half by half and whole, against cuBLAS; CUDA-graph timed with L2 flushed. Prints µs,
the fraction of the copy rate each half streams its weights at, and the error against fp32."""
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from stitchflow.targets.gpu.timing import graph_bench
from stitchflow.targets.gpu.stream_gemm import StreamTiles, stream_gemm

T = StreamTiles
GEMM1 = [T(128, 128, 64, 7, 1, 4), T(64, 128, 64, 8, 1, 4), T(64, 256, 64, 5, 1, 4), T(64, 128, 128, 4, 1, 4)]
GEMM2 = [T(128, 64, 64, 8, 2, 4), T(64, 64, 64, 8, 1, 4), T(64, 64, 128, 6, 1, 4), T(64, 128, 64, 8, 2, 4),
         T(64, 64, 64, 8, 2, 4)]


def small_checks():
    """Odd shapes, bias, both layouts, split-K: relative error against fp32."""
    for M, K, N, act, split, bias in ((100, 512, 384, "gelu", 1, True), (16, 1024, 200, "silu", 2, False),
                                      (130, 2048, 256, "none", 4, True), (1, 512, 128, "relu", 1, False)):
        for linear in (False, True):
            a = torch.randn(M, K, device="cuda").bfloat16()
            w = (torch.randn(N, K, device="cuda") / K ** 0.5).bfloat16()
            b = w.t() if linear else w.t().contiguous()
            bias_t = torch.randn(N, device="cuda").bfloat16() if bias else None
            x = a.float() @ w.float().t() + (bias_t.float() if bias else 0)
            ref = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu, "none": lambda v: v}[act](x)
            try:
                for _ in range(3):  # the semaphores must come back to zero between calls
                    out = stream_gemm(a, b, act=act, bias=bias_t, tiles=StreamTiles(128, 128, 64, 4, split, 8))
                err = ((out.float() - ref).norm() / ref.norm()).item()
                print(f"check M{M} K{K} N{N} {act} split{split} bias={bias} linear={linear}: err {err:.1e} "
                      f"{'ok' if err < 1e-2 else 'WRONG'}", flush=True)
            except Exception as e:
                print(f"check M{M} K{K} N{N} FAIL {type(e).__name__}: {str(e)[:300]}", flush=True)


def main(M=128, K=4096, N=16384, L=4096):
    small_checks()
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    copy_bw = 2 * (1 << 30) / (do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median") * 1e-3)
    read_bw = (1 << 30) / (do_bench(lambda: src.sum(), warmup=10, rep=50, return_mode="median") * 1e-3)
    del src, dst
    print(f"copy {copy_bw / 1e12:.2f} TB/s, read (sum) {read_bw / 1e12:.2f} TB/s ({torch.cuda.get_device_name()})")
    torch.manual_seed(0)
    a = torch.randn(M, K, device="cuda").bfloat16()
    w1 = (torch.randn(N, K, device="cuda") / 64).bfloat16()   # nn.Linear layouts
    w2 = (torch.randn(L, N, device="cuda") / 128).bfloat16()
    layouts = {"rowmajor": (w1.t().contiguous(), w2.t().contiguous())}
    h = F.gelu(a @ layouts["rowmajor"][0])
    ref1, ref2 = F.gelu(a.float() @ w1.float().t()), h.float() @ w2.float().t()

    def show(label, fn, ref, nbytes):
        try:
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            s = graph_bench(fn)[0]
            print(f"{s * 1e6:7.1f} us  {nbytes / s / copy_bw:5.2f} of copy  err {err:.1e}  {label}", flush=True)
            return s
        except Exception as e:
            print(f"    FAIL {label}: {type(e).__name__} {str(e)[:300]}", flush=True)
            return float("inf")

    b1, b2 = layouts["rowmajor"]
    show("G1 cuBLAS + gelu", lambda: F.gelu(a @ b1), ref1, K * N * 2)
    show("G1 cuBLAS alone", lambda: a @ b1, ref1, K * N * 2)
    show("G2 cuBLAS", lambda: h @ b2, ref2, N * L * 2)
    best = {}
    for name, (b1, b2) in layouts.items():
        for t in GEMM1:
            s = show(f"G1 {name} {t}", lambda: stream_gemm(a, b1, act="gelu", tiles=t), ref1, K * N * 2)
            best[(name, 1)] = min(best.get((name, 1), (float("inf"), t)), (s, t), key=lambda x: x[0])
        for t in GEMM2:
            s = show(f"G2 {name} {t}", lambda: stream_gemm(h, b2, tiles=t), ref2, N * L * 2)
            best[(name, 2)] = min(best.get((name, 2), (float("inf"), t)), (s, t), key=lambda x: x[0])
    ref = F.gelu(a.float() @ w1.float().t()).bfloat16().float() @ w2.float().t()
    floor = (K * N + N * L) * 2 / copy_bw
    eager = graph_bench(lambda: F.gelu(a @ w1.t()) @ w2.t())[0]
    print(f"FFN floor {floor * 1e6:.1f} us; eager (nn.Linear layout) {eager * 1e6:.1f} us ({eager / floor:.2f} floor)")
    for name, (b1, b2) in layouts.items():
        t1, t2 = best[(name, 1)][1], best[(name, 2)][1]
        s = show(f"FFN {name} {t1} then {t2}",
                 lambda: stream_gemm(stream_gemm(a, b1, act="gelu", tiles=t1), b2, tiles=t2), ref, 0)
        print(f"   = {s / floor:.3f} x floor, {eager / s:.2f}x eager")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
