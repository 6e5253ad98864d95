"""Device check: the grouped GEMM of siblings.py against torch on CUDA, every tiling the first call times.

    PYTHONPATH=. python scripts/siblings_check.py
"""
import torch

from stitchflow.targets.gpu.siblings import TILINGS, grouped_gemm

CASES = ((512, 768, (768, 768, 768)), (37, 45, (70, 19, 33)), (2048, 4096, (4096, 1024, 1024)))


def main():
    torch.manual_seed(0)
    worst = 0.0
    for dtype in (torch.bfloat16, torch.float32):
        for m, k, widths in CASES:
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            weights = [torch.randn(n, k, device="cuda", dtype=dtype).t() * k ** -0.5 for n in widths]
            biases = [torch.randn(n, device="cuda", dtype=dtype) for n in widths]
            refs = [a.double() @ w.double() + b.double() for w, b in zip(weights, biases)]
            for tiles in TILINGS:
                outs = grouped_gemm(a, weights, biases, [dtype] * len(widths), tiles, exact_fp32=True)
                err = max(((o.double() - r).norm() / r.norm()).item() for o, r in zip(outs, refs))
                worst = max(worst, err / (1e-2 if dtype == torch.bfloat16 else 1e-5))
                print(f"{str(dtype):15} {m}x{k} -> {widths} tiles {tiles.bm}x{tiles.bn}x{tiles.bk} "
                      f"w{tiles.num_warps}: rel err {err:.1e}", flush=True)
    print("all within tolerance" if worst < 1 else f"OVER TOLERANCE ({worst:.1f}x)")


if __name__ == "__main__":
    main()
