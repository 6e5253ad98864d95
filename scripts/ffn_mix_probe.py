"""Device probe: the GPT-6.7B FFN at M=128 put together from different halves — our stream GEMMs,
cuBLAS, our Triton GEMM with max-autotune's GEMM2 tiles — against torch.compile max-autotune, all
CUDA-graph replays after a clean L2 flush (targets/gpu/timing.py). Prints µs per combination."""
import torch
import torch.nn.functional as F

from stitchflow.targets.gpu import chain_kernels as ck
from stitchflow.targets.gpu.stream_gemm import StreamTiles, stream_gemm
from stitchflow.targets.gpu.timing import graph_bench

M, K, N, L = 128, 4096, 16384, 4096
torch.manual_seed(0)
a = torch.randn(M, K, device="cuda").bfloat16()
b = (torch.randn(K, N, device="cuda") / 64).bfloat16()
d = (torch.randn(N, L, device="cuda") / 128).bfloat16()
ref = F.gelu(a.float() @ b.float()).bfloat16().float() @ d.float()
S1, S2 = StreamTiles(128, 128, 64, 7, 1, 4), StreamTiles(128, 64, 64, 8, 2, 4)
G1_STREAM = lambda: stream_gemm(a, b, act="gelu", tiles=S1)  # noqa: E731
G1_CUBLAS = lambda: ck.act_pass(a @ b, "gelu")  # noqa: E731
G2 = {"stream split2": lambda h: stream_gemm(h, d, tiles=S2), "cuBLAS": lambda h: h @ d}
for bm, bn, bk, stages, split in ((64, 64, 128, 5, 1), (64, 64, 128, 4, 1), (64, 128, 64, 4, 2), (32, 64, 128, 5, 1)):
    t = ck.GemmTiles(bm, bn, bk, split, 8, 4, stages)
    G2[f"triton {bm}x{bn}x{bk} s{stages} split{split}"] = lambda h, t=t: ck.gemm(h, d, tiles=t)[0]
rows = []
for g1_name, g1 in (("stream", G1_STREAM), ("cuBLAS+act pass", G1_CUBLAS)):
    for g2_name, g2 in G2.items():
        fn = lambda g1=g1, g2=g2: g2(g1())  # noqa: E731
        err = ((fn().float() - ref).norm() / ref.norm()).item()
        rows.append((graph_bench(fn)[0], f"G1 {g1_name} + G2 {g2_name} (err {err:.1e})"))
ffn = torch.compile(lambda a, b, d: F.gelu(a @ b) @ d, mode="max-autotune-no-cudagraphs")
rows.append((graph_bench(lambda: ffn(a, b, d))[0], "torch.compile max-autotune"))
rows.append((graph_bench(lambda: F.gelu(a @ b) @ d)[0], "eager"))
for s, label in sorted(rows):
    print(f"{s * 1e6:7.1f} us  {label}", flush=True)
