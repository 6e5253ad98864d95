"""Device check: cuBLASLt's activation epilogue (torch._addmm_activation) against torch's GEMM and activation.

For ReLU and GELU: which GELU the epilogue computes on CUDA (the tanh form or erf), its error against each, and
the time of one launch against two, as CUDA-graph replays with L2 evicted clean (timing.graph_bench).

    PYTHONPATH=. python scripts/lt_epilogue_check.py
"""
import torch
import torch.nn.functional as F

from stitchflow.targets.gpu.timing import graph_bench

SHAPES = ((512, 768, 3072), (2048, 768, 3072), (8192, 1024, 4096), (4096, 4096, 11008))


def rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def main():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for m, k, n in SHAPES:
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            w = torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5
            b = torch.randn(n, device="cuda", dtype=dtype)
            h = a.double() @ w.double().t() + b.double()
            for act, use_gelu in (("relu", False), ("gelu", True)):
                lt = torch._addmm_activation(b, a, w.t(), use_gelu=use_gelu)
                if use_gelu:
                    errs = f"vs tanh-GELU {rel(lt, F.gelu(h, approximate='tanh')):.1e}, vs erf {rel(lt, F.gelu(h)):.1e}"
                else:
                    errs = f"vs ReLU {rel(lt, torch.relu(h)):.1e}"
                fn = (lambda: F.gelu(torch.addmm(b, a, w.t()), approximate="tanh")) if use_gelu else \
                    (lambda: torch.relu(torch.addmm(b, a, w.t())))
                t_two = graph_bench(fn)[0] * 1e6
                t_lt = graph_bench(lambda: torch._addmm_activation(b, a, w.t(), use_gelu=use_gelu))[0] * 1e6
                print(f"{str(dtype):15} {m}x{k}x{n} {act:5}: {errs}; addmm + act {t_two:.1f} us, "
                      f"one launch {t_lt:.1f} us ({t_two / t_lt:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
