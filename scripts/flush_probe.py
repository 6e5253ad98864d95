"""Device probe: how the L2 flush between timed replays changes weight-streaming times.

triton.testing.do_bench flushes L2 by zeroing a 256 MB buffer, which leaves L2 full of dirty
lines; a kernel that then streams 134 MB pays for writing ~50 MB of someone else's data back to
HBM. A read flush evicts the same lines clean. Prints µs per method for copies and the FFN halves."""
import statistics

import torch
import torch.nn.functional as F

from stitchflow.targets.gpu.stream_gemm import StreamTiles, stream_gemm

FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
FLUSH_F = FLUSH.view(torch.float32)
FLUSHES = {"zero (do_bench)": FLUSH.zero_, "read": lambda: FLUSH_F.sum(), "none": lambda: None}


def timed(fn, flush, reps=60):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        flush()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def main():
    M, K, N, L = 128, 4096, 16384, 4096
    big = torch.empty(1 << 28, device="cuda")
    big2 = torch.empty_like(big)
    mid = torch.empty(K * N // 2, device="cuda")   # 134 MB, like one FFN half's weights
    mid2 = torch.empty_like(mid)
    a = torch.randn(M, K, device="cuda").bfloat16()
    b1 = (torch.randn(K, N, device="cuda") / 64).bfloat16()
    b2 = (torch.randn(N, L, device="cuda") / 128).bfloat16()
    h = F.gelu(a @ b1)
    t1, t2 = StreamTiles(128, 128, 64, 6, 1, 4), StreamTiles(128, 64, 64, 8, 2, 4)
    cases = {"copy 1 GiB": (lambda: big2.copy_(big), 2 * big.nbytes),
             "copy 134 MB": (lambda: mid2.copy_(mid), 2 * mid.nbytes),
             "read 134 MB (sum)": (lambda: mid.sum(), mid.nbytes),
             "G1 cuBLAS": (lambda: a @ b1, b1.nbytes), "G1 cuBLAS+gelu": (lambda: F.gelu(a @ b1), b1.nbytes),
             f"G1 {t1}": (lambda: stream_gemm(a, b1, act="gelu", tiles=t1), b1.nbytes),
             "G2 cuBLAS": (lambda: h @ b2, b2.nbytes), f"G2 {t2}": (lambda: stream_gemm(h, b2, tiles=t2), b2.nbytes),
             "FFN eager": (lambda: F.gelu(a @ b1) @ b2, b1.nbytes + b2.nbytes),
             "FFN ours": (lambda: stream_gemm(stream_gemm(a, b1, act="gelu", tiles=t1), b2, tiles=t2),
                          b1.nbytes + b2.nbytes)}
    print(f"{torch.cuda.get_device_name()}; TB/s = bytes moved / time")
    for name, (fn, nbytes) in cases.items():
        row = [f"{name:28s}"]
        for fl, flush in FLUSHES.items():
            us = timed(fn, flush)
            row.append(f"{fl}: {us:7.1f} us {nbytes / us / 1e6:5.2f} TB/s")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
