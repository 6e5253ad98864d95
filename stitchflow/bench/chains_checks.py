"""Correctness of the chain kernels and plans on the GPU, for `stitchflow bench chains`.

Each check runs one kernel or plan at odd shapes (fp32 and bf16) and compares it with float64
torch; the bench runs them before timing anything and reports them with its table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEVICE = "cuda"


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def device_checks(dtypes=(torch.float32, torch.bfloat16)) -> list[dict]:
    """The Triton kernels and library plans at odd shapes, fp32 and bf16, against float64 torch."""
    from stitchflow.targets.gpu import chain_kernels as ck

    gen = torch.Generator(device=DEVICE).manual_seed(7)
    results = []
    for dtype, tol in ((dt, 1e-4 if dt == torch.float32 else 2e-2) for dt in dtypes):
        M, K, N, L = 301, 200, 333, 77
        a = torch.randn(M, K, device=DEVICE, generator=gen).to(dtype)
        b, bu = (torch.randn(K, N, device=DEVICE, generator=gen).div(K ** 0.5).to(dtype) for _ in range(2))
        d = torch.randn(N, L, device=DEVICE, generator=gen).div(N ** 0.5).to(dtype)
        b1 = torch.randn(N, device=DEVICE, generator=gen).to(dtype)
        r = torch.randn(M, N, device=DEVICE, generator=gen).to(dtype)
        A, B, Bu, D, B1, R = (t.double() for t in (a, b, bu, d, b1, r))
        h = F.gelu(A @ B + B1).to(dtype).double()
        hg = (F.silu(A @ B).to(dtype).double() * (A @ Bu).to(dtype).double()).to(dtype).double()
        cases = {
            "chain gelu+bias": (lambda: ck.chain(a, b, d, act="gelu", bias1=b1, exact_fp32=True,
                                                 tiles=ck.ChainTiles(64, 64, 64, 64))[0], h @ D),
            "chain split_n=3": (lambda: ck.chain(a, b, d, act="gelu", bias1=b1, exact_fp32=True,
                                                 tiles=ck.ChainTiles(32, 64, 64, 128, split_n=3))[0], h @ D),
            "chain gated": (lambda: ck.chain(a, b, d, act="silu", bu=bu, exact_fp32=True,
                                             tiles=ck.ChainTiles(64, 32, 64, 64))[0], hg @ D),
            "gemm epilogue": (lambda: ck.gemm(a, b, epi=ck.Epilogue(0.5, True, "silu", True), bias=b1, residual=r,
                                              exact_fp32=True, tiles=ck.GemmTiles(64, 64, 32))[0],
                              F.silu(0.5 * (A @ B) + B1) + R),
            "gemm split_k=4": (lambda: ck.gemm(a, b, epi=ck.Epilogue(act="relu"), exact_fp32=True,
                                               tiles=ck.GemmTiles(64, 64, 32, split_k=4))[0], torch.relu(A @ B)),
            "gemm rowmax": (lambda: ck.gemm(a, b, epi=ck.Epilogue(rowstat="max"), exact_fp32=True)[1],
                            (A @ B).to(dtype).double().amax(1)),
            "gemm gated": (lambda: ck.gemm(a, b, bu=bu, epi=ck.Epilogue(act="silu"), exact_fp32=True)[0],
                           F.silu(A @ B) * (A @ Bu)),
        }
        a2, b2, d2 = a[:256, :128].contiguous(), b[:128, :256].contiguous(), d[:256, :64].contiguous()
        A2, B2, D2 = (t.double() for t in (a2, b2, d2))
        cases["chain even split_n=2"] = (lambda: ck.chain(a2, b2, d2, act="relu", exact_fp32=True,
                                                          tiles=ck.ChainTiles(64, 64, 64, 64, split_n=2))[0],
                                         torch.relu(A2 @ B2).to(dtype).double() @ D2)
        cases["gemm even split_k=2"] = (lambda: ck.gemm(a2, b2, exact_fp32=True, tiles=ck.GemmTiles(64, 64, 32, 2))[0],
                                        A2 @ B2)
        cases.update(_new_kernel_checks(a, b, bu, d, b1, h, hg, D, dtype))
        for name, (fn, ref) in cases.items():
            results.append({"check": f"{name} {str(dtype)[6:]}", **_run_check(fn, ref, tol)})
    return results


class Refusal(str):
    """The expected outcome of a check that must be refused: words its ValueError says."""


def _run_check(fn, ref, tol: float) -> dict:
    """Run one check: its error against `ref` within `tol`, or, where `ref` is a Refusal, the refusal."""
    try:
        out = fn()
    except Exception as exc:  # a broken check is a failed check, not a lost run
        note = f"{type(exc).__name__}: {str(exc)[:160]}"
        refused = isinstance(ref, Refusal) and isinstance(exc, ValueError) and ref in str(exc)
        return {"rel_err": float("nan"), "ok": refused, "error": note}
    if isinstance(ref, Refusal):
        return {"rel_err": float("nan"), "ok": False, "error": f"ran where it should refuse ({ref})"}
    err = rel_err(out, ref)
    return {"rel_err": err, "ok": err < tol, "error": ""}


def _new_kernel_checks(a, b, bu, d, b1, h, hg, D, dtype) -> dict:
    """The persistent kernel (both orientations), the TMA GEMM, and the polynomial Φ of the GELU."""
    from stitchflow.targets.gpu import chain_kernels as ck
    from stitchflow.targets.gpu.chain_resident import ResidentTiles, resident_chain
    from stitchflow.targets.gpu.gemm_tma import gemm_tma

    a64, b64, d64 = a[:, :64].contiguous(), b[:64, :].contiguous(), d.contiguous()
    h64 = F.gelu(a64.double() @ b64.double() + b1.double()).to(dtype).double()
    x = torch.linspace(-12, 12, 1 << 20, device=DEVICE, dtype=torch.float64)
    A8, B8 = a[:, :192].contiguous(), b[:192, :320].contiguous()  # rows 16-byte aligned, as TMA needs
    return {
        "resident gelu+bias": (lambda: resident_chain(a64, b64, d64, act="gelu", bias1=b1, exact_fp32=True,
                                                      tiles=ResidentTiles(64, 64, 4))[0], h64 @ D),
        "resident transposed": (lambda: resident_chain(a64, b64[:, :256], d64[:256], act="gelu", bias1=b1[:256],
                                                       exact_fp32=True, tiles=ResidentTiles(64, transposed=True))[0],
                                # fp32 operands are refused (NaNs with tf32 on the H200), and the check expects that
                                h64[:, :256] @ D[:256] if dtype != torch.float32 else Refusal("16-bit operands only")),
        "resident gated": (lambda: resident_chain(a64, b64, d64, act="silu", bu=bu[:64].contiguous(),
                                                  exact_fp32=True, tiles=ResidentTiles(64, 128, 8))[0],
                           (F.silu(a64.double() @ b64.double()).to(dtype).double() *
                            (a64.double() @ bu[:64].double()).to(dtype).double()).to(dtype).double() @ D),
        "tma gemm split_k=3": (lambda: gemm_tma(A8, B8, epi=ck.Epilogue(act="relu"), exact_fp32=True,
                                                tiles=ck.GemmTiles(64, 64, 64, split_k=3))[0],
                               torch.relu(A8.double() @ B8.double())),
        **_library_plan_checks(a, b, bu, d, b1, h, hg, D, dtype),
        "gelu polynomial": (lambda: ck.gemm(x.float()[:, None].contiguous(), torch.ones(1, 16, device=DEVICE),
                                            epi=ck.Epilogue(act="gelu"), exact_fp32=True,
                                            tiles=ck.GemmTiles(64, 16, 16))[0][:, 0],
                            F.gelu(x.float().double())),
    }


def _library_plan_checks(a, b, bu, d, b1, h, hg, D, dtype) -> dict:
    """cuBLAS GEMM1 with our act pass (gated too) or our act-on-load GEMM2, and cuDNN's conv."""
    from stitchflow.targets.gpu import chain_kernels as ck
    from stitchflow.targets.gpu.chain_cost import Plan
    from stitchflow.targets.gpu.chains import Operands, conv_operands, run_plan

    epi, pro = Plan("cublas_epi", "", ()), Plan("cublas_pro", "", (), gemm2=ck.GemmTiles(64, 64, 64))
    x = torch.randn(3, 24, 13, 11, device=DEVICE).to(dtype)
    w = torch.randn(40, 24, 3, 3, device=DEVICE).div(216 ** 0.5).to(dtype)
    d2 = d[:40, :24].contiguous()
    hc = F.gelu(F.conv2d(x.double(), w.double(), padding=1)).to(dtype).permute(0, 2, 3, 1).reshape(-1, 40)
    conv = conv_operands(x, w, d2, padding=1, act="gelu")
    return {
        "cublas_epi gelu+bias": (lambda: run_plan(epi, Operands(a, b, d, bias1=b1, act="gelu"), True), h @ D),
        "cublas_epi gated": (lambda: run_plan(epi, Operands(a, b, d, bu=bu, act="silu"), True), hg @ D),
        "cublas_pro gelu+bias": (lambda: run_plan(pro, Operands(a, b, d, bias1=b1, act="gelu"), True), h @ D),
        "conv cudnn+act pass": (lambda: run_plan(epi, conv, True), hc.double() @ d2.double()),
        "conv cudnn+act on load": (lambda: run_plan(pro, conv, True), hc.double() @ d2.double()),
    }


def dsm_check() -> list[dict]:
    from stitchflow.targets.gpu.cluster_dsm import dsm_chain

    gen = torch.Generator(device=DEVICE).manual_seed(11)
    out = []
    for M, K, N, L, C in ((100, 96, 512, 128, 4), (129, 64, 1024, 64, 16), (64, 128, 256, 256, 2), (70, 32, 1024, 64, 8)):
        a = torch.randn(M, K, device=DEVICE, generator=gen).bfloat16()
        b = torch.randn(K, N, device=DEVICE, generator=gen).div(K ** 0.5).bfloat16()
        d = torch.randn(N, L, device=DEVICE, generator=gen).div(N ** 0.5).bfloat16()
        b1 = torch.randn(N, device=DEVICE, generator=gen).bfloat16()
        b2 = torch.randn(L, device=DEVICE, generator=gen).bfloat16()
        ref = F.gelu(a.double() @ b.double() + b1.double()).bfloat16().double() @ d.double() + b2.double()
        err = rel_err(dsm_chain(a, b, d, act="gelu", bias1=b1, bias2=b2, cluster=C), ref)
        out.append({"check": f"dsm M{M} K{K} N{N} L{L} C{C}", "rel_err": err, "ok": err < 2e-2})
    return out


TORCH_ACTS = {"gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"), "silu": F.silu,
              "relu": torch.relu, "none": lambda v: v}


def _gluon_unavailable(what: str) -> bool:
    """True (and says why) when the Gluon kernels cannot run here."""
    from stitchflow.targets.gpu.chain_wgmma import gluon_refusal

    if torch.cuda.get_device_capability()[0] != 9 or gluon_refusal():
        print(f"{what} checks skipped:", gluon_refusal() or "not a Hopper GPU (the plans leave the kind out too)")
        return True
    return False


def wgmma_checks() -> list[dict]:
    """The Gluon wgmma chain kernel (Hopper only): resident and streamed weights, every activation,
    with and without bias, row counts that leave a partial last tile, bf16 and fp16."""
    from stitchflow.targets.gpu.chain_wgmma import WgmmaTiles, chain_wgmma

    if _gluon_unavailable("wgmma"):
        return []
    gen = torch.Generator(device=DEVICE).manual_seed(13)
    acts = TORCH_ACTS
    out = []
    for (M, K, N, L), tiles, act, dtype in (
            ((1000, 64, 256, 64), WgmmaTiles(64, 128, 4, 2, 2, 2), "gelu", torch.bfloat16),
            ((777, 64, 256, 64), WgmmaTiles(128, 64, 8, 3, 2, 1), "silu", torch.float16),
            ((5000, 128, 512, 128), WgmmaTiles(64, 64, 4, 2, 2, 2), "gelu", torch.bfloat16),   # streamed
            ((300, 32, 192, 16), WgmmaTiles(64, 64, 4, 2, 2, 2), "gelu_tanh", torch.bfloat16),
            ((129, 256, 128, 256), WgmmaTiles(64, 64, 4, 2, 2, 1), "relu", torch.bfloat16),    # streamed
            ((64, 64, 64, 64), WgmmaTiles(64, 64, 4, 2, 2, 2), "none", torch.bfloat16)):
        a = torch.randn(M, K, device=DEVICE, generator=gen).to(dtype)
        b = torch.randn(K, N, device=DEVICE, generator=gen).div(K ** 0.5).to(dtype)
        d = torch.randn(N, L, device=DEVICE, generator=gen).div(N ** 0.5).to(dtype)
        for bias in (False, True):
            if bias:  # nn.Linear's layout: B = W1.t(), D = W2.t() (K-major in shared memory)
                b, d = b.t().contiguous().t(), d.t().contiguous().t()
            b1 = torch.randn(N, device=DEVICE, generator=gen).to(dtype) if bias else None
            pre = a.double() @ b.double() + (b1.double() if bias else 0)
            ref = acts[act](pre).to(dtype).double() @ d.double()
            try:
                err, note = rel_err(chain_wgmma(a, b, d, act=act, bias1=b1, tiles=tiles), ref), ""
            except Exception as exc:  # a broken check is a failed check, not a lost run
                err, note = float("nan"), f"{type(exc).__name__}: {str(exc)[:160]}"
            name = f"wgmma {act}{'+bias, W.t()' if bias else ''} M{M} K{K} N{N} L{L} {tiles} {str(dtype)[6:]}"
            out.append({"check": name, "rel_err": err, "ok": err < 2e-2, "error": note})
    return out


def stream_checks() -> list[dict]:
    """The Gluon weight-streaming GEMM (Hopper only): odd M and N, bias, every activation, split-K
    finished on the semaphores (called three times: they must come back to zero), row-major and
    nn.Linear (W.t()) weights, bf16 and fp16."""
    from stitchflow.targets.gpu.stream_gemm import StreamTiles, stream_gemm

    if _gluon_unavailable("stream"):
        return []
    gen = torch.Generator(device=DEVICE).manual_seed(17)
    acts = TORCH_ACTS
    out = []
    for (M, K, N), tiles, act, dtype in (
            ((100, 512, 384), StreamTiles(128, 128, 64, 4, 1, 4), "gelu", torch.bfloat16),
            ((16, 1024, 200), StreamTiles(64, 64, 128, 4, 2, 4), "silu", torch.float16),
            ((130, 2048, 256), StreamTiles(128, 128, 64, 6, 4, 8), "none", torch.bfloat16),
            ((1, 512, 136), StreamTiles(64, 256, 64, 4, 1, 4), "gelu_tanh", torch.bfloat16),
            ((128, 4096, 1024), StreamTiles(128, 64, 64, 8, 2, 4), "relu", torch.bfloat16)):
        a = torch.randn(M, K, device=DEVICE, generator=gen).to(dtype)
        w = torch.randn(N, K, device=DEVICE, generator=gen).div(K ** 0.5).to(dtype)
        for linear in (False, True):
            b = w.t() if linear else w.t().contiguous()
            bias = torch.randn(N, device=DEVICE, generator=gen).to(dtype) if linear else None
            ref = acts[act](a.double() @ b.double() + (bias.double() if linear else 0))
            try:
                for _ in range(3):
                    got = stream_gemm(a, b, act=act, bias=bias, tiles=tiles)
                err, note = rel_err(got, ref), ""
            except Exception as exc:  # a broken check is a failed check, not a lost run
                err, note = float("nan"), f"{type(exc).__name__}: {str(exc)[:160]}"
            name = f"stream {act}{'+bias, W.t()' if linear else ''} M{M} K{K} N{N} {tiles} {str(dtype)[6:]}"
            out.append({"check": name, "rel_err": err, "ok": err < 2e-2, "error": note})
    return out

