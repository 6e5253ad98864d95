"""Triton kernels for compute chains: GEMM with fused prologue/epilogue, and GEMM → act → GEMM.

Three kernels, parameterized by compile-time flags rather than generated text, because the
chain shapes the IR presents reduce to a fixed epilogue order (see `Epilogue`):

- `gemm_kernel`: C = epi(pro(A)·B), optionally gated (silu(A·Bg + bg) * (A·Bu + bu)), optionally
  split over K into fp32 partials that `epilogue_kernel` sums before applying the epilogue
  (an activation cannot be applied to a partial sum).
- `chain_kernel`: E = epi2(h·D) with h = act(A·B + b1) [* (A·Bu + bu)] computed chunk by chunk
  over N in registers and multiplied by the D chunk at once, so the M×N intermediate never
  leaves the chip. Each program owns a BM×BL output tile; SPLIT_N > 1 splits the N loop over
  programs, which then write fp32 partials reduced by `epilogue_kernel`.
- `epilogue_kernel`: sums split partials and applies bias, activation, residual, cast and row
  statistics.

Every load is masked, so odd shapes work; fp32 accumulation throughout. PREC picks the dot's
input precision for fp32 operands ("ieee" in tests, "tf32" for speed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ACTS = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4, "sigmoid": 5, "gelu_libdevice": 6}
ROWSTATS = {"none": 0, "sum": 1, "max": 2}


@dataclass(frozen=True)
class Epilogue:
    """y = act(alpha * acc + bias) + residual, cast to the output dtype; optional row sum/max of y.

    Prologue (on A as loaded): A' = pro_act(row_scale[m] * A)."""

    alpha: float = 1.0
    bias: bool = False
    act: str = "none"
    residual: bool = False
    rowstat: str = "none"
    row_scale: bool = False
    pro_act: str = "none"

    def __str__(self) -> str:
        parts = [f"{self.alpha}*acc" if self.alpha != 1.0 else "acc"]
        if self.bias:
            parts.append("+bias")
        text = "".join(parts)
        text = f"{self.act}({text})" if self.act != "none" else text
        if self.residual:
            text += "+res"
        if self.rowstat != "none":
            text += f" [row{self.rowstat}]"
        return text


@triton.jit
def _normal_cdf(x):
    """Φ(x) to 8e-8 absolute (fp32 rounding), for the exact (erf) GELU x·Φ(x), in 13 FMA-pipe
    instructions and one ex2 — about half of libdevice's erf: in the memory-bound chains
    (65536×64→256→64) the activation, not memory or the tensor cores, bounds the fused kernel.
    The tail q(u) = Φ(-u), u = |x|, is exp2 of a degree-10 polynomial in u fitted (weighted
    minimax, tests/targets/gpu/test_chain_math.py checks it against float64) on [0, 9]; past 9,
    q < 1.2e-19. Φ(x) = 1 - q for x ≥ 0, else q: no cancellation in the negative tail."""
    u = tl.minimum(tl.abs(x), 9.0)
    p = -5.962472894e-08
    p = p * u + 1.446130619e-06
    p = p * u - 1.560360705e-05
    p = p * u + 9.602733226e-05
    p = p * u - 3.273216060e-04
    p = p * u + 6.746590707e-05
    p = p * u + 6.893597688e-03
    p = p * u - 5.242007823e-02
    p = p * u - 4.592241689e-01
    p = p * u - 1.151104102e+00
    p = p * u - 9.999999998e-01
    q = tl.math.exp2(p)
    return tl.where(x >= 0, 1.0 - q, q)


@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 1:
        x = tl.maximum(x, 0.0)
    elif ACT == 2:
        x = x * _normal_cdf(x)
    elif ACT == 6:  # the textbook form through libdevice's erf, kept to measure _normal_cdf against
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 3:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        x = 0.5 * x * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    elif ACT == 4:
        x = x * tl.sigmoid(x)
    elif ACT == 5:
        x = tl.sigmoid(x)
    return x


@triton.jit
def _mma(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """acc += a·b. UPCAST (set under TRITON_INTERPRET) widens bf16 tiles first: Triton 3.6's
    interpreter multiplies bf16 operands as their raw 16-bit integers. Products of bf16 values
    are exact in fp32, so the result equals the tensor cores' bf16 dot with fp32 accumulation."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _load(ptr, mask, MASKED: tl.constexpr):
    """A tile load; unmasked where the shape is a multiple of the tile, so it can be vectorized."""
    if MASKED:
        return tl.load(ptr, mask=mask, other=0.0)
    return tl.load(ptr)


@triton.jit
def _finish_tile(y, offs_m, offs_n, M, N, c_ptr, scm, scn, bias_ptr, res_ptr, srm, srn, stat_ptr, alpha,
                 ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROWSTAT: tl.constexpr):
    """The shared epilogue: scale, bias, activation, residual, cast, store, row statistics."""
    m_ok = offs_m < M
    n_ok = offs_n < N
    mask = m_ok[:, None] & n_ok[None, :]
    y = y * alpha
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = _act(y, ACT)
    if HAS_RES:
        y += tl.load(res_ptr + offs_m[:, None] * srm + offs_n[None, :] * srn, mask=mask, other=0.0).to(tl.float32)
    out = y.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + offs_m[:, None] * scm + offs_n[None, :] * scn, out, mask=mask)
    if ROWSTAT == 1:  # statistics of the value stored (after the cast), as a separate op would see it
        part = tl.sum(tl.where(mask, out.to(tl.float32), 0.0), axis=1)
        tl.atomic_add(stat_ptr + offs_m, part, mask=m_ok)
    elif ROWSTAT == 2:
        part = tl.max(tl.where(mask, out.to(tl.float32), float("-inf")), axis=1)
        tl.atomic_max(stat_ptr + offs_m, part, mask=m_ok)


@triton.jit
def _grouped_tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid in grouped order: GROUP_M row tiles walk the same
    weight columns together, so B stays in L2."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % group_rows, (pid % width) // group_rows


@triton.jit
def _split_range(part, size, B: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr):
    """[lo, hi) of a reduction dimension of `size` for split `part` of SPLIT. EVEN (size a
    multiple of B * SPLIT): plain division, so the bounds keep size's divisibility and loads
    along it need no mask (a bound built from min(lo + per, size) hides it and turns the
    contiguous loads into scalar ones)."""
    if EVEN:
        per = size // SPLIT
        lo = part * per
        hi = lo + per
    else:
        per = tl.cdiv(tl.cdiv(size, B), SPLIT) * B
        lo = part * per
        hi = tl.minimum(lo + per, size)
    return lo, hi


@triton.jit
def gemm_kernel(a_ptr, b_ptr, bu_ptr, c_ptr, bias_ptr, biasu_ptr, res_ptr, stat_ptr, rscale_ptr,
                M, N, K, sam, sak, sbk, sbn, scm, scn, srm, srn, alpha,
                ACT: tl.constexpr, PRO_ACT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_BIASU: tl.constexpr, HAS_RES: tl.constexpr, HAS_RSCALE: tl.constexpr, ROWSTAT: tl.constexpr,
                SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid_k = tl.program_id(1)
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo, k_hi = _split_range(pid_k, K, BK, SPLIT_K, EVEN_K)  # EVEN_K: no mask along K, A's contiguous dim
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    accu = tl.zeros((BM, BN), dtype=tl.float32)
    if HAS_RSCALE:
        rscale = tl.load(rscale_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        ks = k0 + offs_k
        if EVEN_K:
            a_mask = m_ok[:, None]
            b_mask = n_ok[None, :]
        else:
            k_ok = ks < k_hi
            a_mask = m_ok[:, None] & k_ok[None, :]
            b_mask = k_ok[:, None] & n_ok[None, :]
        a = tl.load(a_ptr + offs_m[:, None] * sam + ks[None, :] * sak, mask=a_mask, other=0.0)
        if HAS_RSCALE or PRO_ACT != 0:
            af = a.to(tl.float32)
            if HAS_RSCALE:
                af = af * rscale[:, None]
            a = _act(af, PRO_ACT).to(a_ptr.dtype.element_ty)
        b_off = ks[:, None] * sbk + offs_n[None, :] * sbn
        acc = _mma(a, tl.load(b_ptr + b_off, mask=b_mask, other=0.0), acc, PREC, UPCAST)
        if GATED:
            accu = _mma(a, tl.load(bu_ptr + b_off, mask=b_mask, other=0.0), accu, PREC, UPCAST)
    _gemm_epilogue(acc, accu, offs_m, offs_n, pid_k, M, N, c_ptr, scm, scn, bias_ptr, biasu_ptr, res_ptr, srm, srn,
                   stat_ptr, alpha, ACT, GATED, HAS_BIAS, HAS_BIASU, HAS_RES, ROWSTAT, SPLIT_K)


@triton.jit
def _gemm_epilogue(acc, accu, offs_m, offs_n, pid_k, M, N, c_ptr, scm, scn, bias_ptr, biasu_ptr, res_ptr, srm, srn,
                   stat_ptr, alpha, ACT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HAS_BIASU: tl.constexpr, HAS_RES: tl.constexpr, ROWSTAT: tl.constexpr, SPLIT_K: tl.constexpr):
    """A GEMM tile's end: fp32 partials when split over K, else the gate and the shared epilogue."""
    m_ok = offs_m < M
    n_ok = offs_n < N
    if SPLIT_K > 1:  # fp32 partials; epilogue_kernel sums them and finishes
        ws = c_ptr + pid_k * M * N
        tl.store(ws + offs_m[:, None] * N + offs_n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        if GATED:  # h = act(A·Bg + bg) * (A·Bu + bu); the epilogue below then only casts
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if HAS_BIASU:
                accu += tl.load(biasu_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            acc = _act(acc * alpha, ACT) * accu
            _finish_tile(acc, offs_m, offs_n, M, N, c_ptr, scm, scn, bias_ptr, res_ptr, srm, srn, stat_ptr, 1.0,
                         0, False, HAS_RES, ROWSTAT)
        else:
            _finish_tile(acc, offs_m, offs_n, M, N, c_ptr, scm, scn, bias_ptr, res_ptr, srm, srn, stat_ptr, alpha,
                         ACT, HAS_BIAS, HAS_RES, ROWSTAT)


@triton.jit
def chain_kernel(a_ptr, b_ptr, bu_ptr, d_ptr, out_ptr, bias1_ptr, biasu_ptr, bias2_ptr, res_ptr, stat_ptr,
                 M, N, K, L, sam, sak, sbk, sbn, sdn, sdl, som, sol, srm, srl, alpha2,
                 ACT: tl.constexpr, GATED: tl.constexpr, HAS_B1: tl.constexpr, HAS_BU: tl.constexpr,
                 ACT2: tl.constexpr, HAS_B2: tl.constexpr, HAS_RES: tl.constexpr, ROWSTAT: tl.constexpr,
                 SPLIT_N: tl.constexpr, A_RESIDENT: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                 PREC: tl.constexpr,
                 UPCAST: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BL: tl.constexpr):
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    num_l = tl.cdiv(L, BL)
    pid_m = pid // num_l
    pid_l = pid % num_l
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_l = pid_l * BL + tl.arange(0, BL)
    offs_n = tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_ok = offs_m < M
    l_ok = offs_l < L
    n_lo, n_hi = _split_range(pid_s, N, BN, SPLIT_N, EVEN_N)  # EVEN_N: no mask along N, B's contiguous dim
    if A_RESIDENT:  # K fits one tile: load the A row tile once and keep it for every N chunk
        a_res = tl.load(a_ptr + offs_m[:, None] * sam + offs_k[None, :] * sak,
                        mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
    acc2 = tl.zeros((BM, BL), dtype=tl.float32)
    for n0 in range(n_lo, n_hi, BN):
        ns = n0 + offs_n
        n_ok = ns < n_hi
        acc1 = tl.zeros((BM, BN), dtype=tl.float32)
        accu = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):  # the reduction loop sits innermost, before the activation
            ks = k0 + offs_k
            if EVEN_K and EVEN_N:
                a_mask = m_ok[:, None]
                b_mask = None
            elif EVEN_K:
                a_mask = m_ok[:, None]
                b_mask = n_ok[None, :]
            elif EVEN_N:
                a_mask = m_ok[:, None] & (ks < K)[None, :]
                b_mask = (ks < K)[:, None]
            else:
                a_mask = m_ok[:, None] & (ks < K)[None, :]
                b_mask = (ks < K)[:, None] & n_ok[None, :]
            if A_RESIDENT:
                a = a_res
            else:
                a = tl.load(a_ptr + offs_m[:, None] * sam + ks[None, :] * sak, mask=a_mask, other=0.0)
            b_off = ks[:, None] * sbk + ns[None, :] * sbn
            acc1 = _mma(a, _load(b_ptr + b_off, b_mask, not (EVEN_K and EVEN_N)), acc1, PREC, UPCAST)
            if GATED:
                accu = _mma(a, _load(bu_ptr + b_off, b_mask, not (EVEN_K and EVEN_N)), accu, PREC, UPCAST)
        if HAS_B1:
            acc1 += tl.load(bias1_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        h = _act(acc1, ACT)
        if GATED:
            if HAS_BU:
                accu += tl.load(biasu_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            h = h * accu
        # Round h to the weights' dtype, as the unfused program stores it; D rows past N load as 0.
        if EVEN_N:
            d = tl.load(d_ptr + ns[:, None] * sdn + offs_l[None, :] * sdl, mask=l_ok[None, :], other=0.0)
        else:
            d = tl.load(d_ptr + ns[:, None] * sdn + offs_l[None, :] * sdl, mask=n_ok[:, None] & l_ok[None, :],
                        other=0.0)
        acc2 = _mma(h.to(d_ptr.dtype.element_ty), d, acc2, PREC, UPCAST)
    if SPLIT_N > 1:
        ws = out_ptr + pid_s * M * L
        tl.store(ws + offs_m[:, None] * L + offs_l[None, :], acc2, mask=m_ok[:, None] & l_ok[None, :])
    else:
        _finish_tile(acc2, offs_m, offs_l, M, L, out_ptr, som, sol, bias2_ptr, res_ptr, srm, srl, stat_ptr, alpha2,
                     ACT2, HAS_B2, HAS_RES, ROWSTAT)


@triton.jit
def epilogue_kernel(ws_ptr, c_ptr, bias_ptr, res_ptr, stat_ptr, M, N, scm, scn, srm, srn, alpha,
                    SPLIT: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                    ROWSTAT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    y = tl.zeros((BM, BN), dtype=tl.float32)
    for s in range(SPLIT):
        y += tl.load(ws_ptr + s * M * N + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0.0)
    _finish_tile(y, offs_m, offs_n, M, N, c_ptr, scm, scn, bias_ptr, res_ptr, srm, srn, stat_ptr, alpha,
                 ACT, HAS_BIAS, HAS_RES, ROWSTAT)


@triton.jit
def act_pass_kernel(g_ptr, u_ptr, out_ptr, bias_ptr, biasu_ptr, M, N, sgm, sgn, sum_, sun, som, son,
                    ACT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_BIASU: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr):
    """h = act(G + bias) [* (U + biasu)] in one pass over library GEMM outputs (cuBLAS, cuDNN):
    what eager runs as two or three elementwise kernels. Rounds like eager: the activation's
    output is cast to the storage dtype before the gate multiplies it."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    mask = (offs_m < M)[:, None] & n_ok[None, :]
    y = tl.load(g_ptr + offs_m[:, None] * sgm + offs_n[None, :] * sgn, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = (y + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :])
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    y = _act(y, ACT)
    if GATED:
        u = tl.load(u_ptr + offs_m[:, None] * sum_ + offs_n[None, :] * sun, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIASU:
            u = (u + tl.load(biasu_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :])
            u = u.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32) * u
    tl.store(out_ptr + offs_m[:, None] * som + offs_n[None, :] * son, y.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- launchers

def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class GemmTiles:
    bm: int = 64
    bn: int = 64
    bk: int = 32
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class ChainTiles:
    bm: int = 64
    bn: int = 64
    bk: int = 32
    bl: int = 64
    split_n: int = 1
    num_warps: int = 4
    num_stages: int = 2


def dot_precision(dtype: torch.dtype, exact_fp32: bool) -> str:
    """fp32 operands: exact products ("ieee", as torch's matmuls by default) or tf32 (where
    torch.set_float32_matmul_precision allows it for torch's own, chains.compile_chain)."""
    return "ieee" if dtype == torch.float32 and exact_fp32 else "tf32"


def _stat_buffer(rows: int, kind: str, device) -> torch.Tensor | None:
    if kind == "none":
        return None
    fill = 0.0 if kind == "sum" else float("-inf")
    return torch.full((rows,), fill, dtype=torch.float32, device=device)


def _finish_partials(ws, split, out, epi: Epilogue, bias, residual, stat):
    rows, cols = out.shape
    grid = (triton.cdiv(rows, 32), triton.cdiv(cols, 128))
    res = residual if residual is not None else out
    epilogue_kernel[grid](ws, out, bias if bias is not None else out, res, stat if stat is not None else ws,
                          rows, cols, out.stride(0), out.stride(1), res.stride(0), res.stride(1), epi.alpha,
                          SPLIT=split, ACT=ACTS[epi.act], HAS_BIAS=bias is not None, HAS_RES=residual is not None,
                          ROWSTAT=ROWSTATS[epi.rowstat], BM=32, BN=128, num_warps=4)


def gemm(a, b, *, epi: Epilogue = Epilogue(), bias=None, bu=None, biasu=None, residual=None, row_scale=None,
         out_dtype=None, tiles: GemmTiles = GemmTiles(), exact_fp32: bool = False):
    """C = epi(pro(A)·B) for A: M×K, B: K×N (any strides; pass w.t() for a linear weight).
    With `bu`: C = act(alpha·A·B + bias) * (A·Bu + biasu). Returns (C, row statistic or None)."""
    M, K = a.shape
    N = b.shape[1]
    out = torch.empty((M, N), dtype=out_dtype or a.dtype, device=a.device)
    stat = _stat_buffer(M, epi.rowstat, a.device)
    gated = bu is not None
    split = tiles.split_k
    if gated and split > 1:
        raise ValueError("a gated GEMM is not split over K: the gate needs whole sums")
    target = torch.empty((split, M, N), dtype=torch.float32, device=a.device) if split > 1 else out
    res = residual if residual is not None else out
    grid = (triton.cdiv(M, tiles.bm) * triton.cdiv(N, tiles.bn), split)
    gemm_kernel[grid](
        a, b, bu if gated else b, target, bias if bias is not None else a, biasu if biasu is not None else a,
        res, stat if stat is not None else target, row_scale if row_scale is not None else a,
        M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        res.stride(0), res.stride(1), epi.alpha,
        ACT=ACTS[epi.act], PRO_ACT=ACTS[epi.pro_act], GATED=gated, HAS_BIAS=bias is not None,
        HAS_BIASU=biasu is not None, HAS_RES=residual is not None and split == 1, HAS_RSCALE=row_scale is not None,
        ROWSTAT=ROWSTATS[epi.rowstat] if split == 1 else 0, SPLIT_K=split, EVEN_K=K % (tiles.bk * split) == 0,
        PREC=dot_precision(a.dtype, exact_fp32), UPCAST=interpreting(), BM=tiles.bm, BN=tiles.bn, BK=tiles.bk,
        GROUP_M=tiles.group_m,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if split > 1:
        _finish_partials(target, split, out, epi, bias, residual, stat)
    return out, stat


def chain(a, b, d, *, act: str = "none", bias1=None, bu=None, biasu=None, epi2: Epilogue = Epilogue(), bias2=None,
          residual=None, out_dtype=None, tiles: ChainTiles = ChainTiles(), exact_fp32: bool = False):
    """E = epi2(h·D), h = act(A·B + bias1) [* (A·Bu + biasu)], in one kernel (plus a partial-sum
    reduction when tiles.split_n > 1). A: M×K, B, Bu: K×N, D: N×L. Returns (E, row statistic)."""
    M, K = a.shape
    N, L = d.shape
    out = torch.empty((M, L), dtype=out_dtype or a.dtype, device=a.device)
    stat = _stat_buffer(M, epi2.rowstat, a.device)
    split = tiles.split_n
    target = torch.empty((split, M, L), dtype=torch.float32, device=a.device) if split > 1 else out
    res = residual if residual is not None else out
    grid = (triton.cdiv(M, tiles.bm) * triton.cdiv(L, tiles.bl), split)
    chain_kernel[grid](
        a, b, bu if bu is not None else b, d, target, bias1 if bias1 is not None else a,
        biasu if biasu is not None else a, bias2 if bias2 is not None else a, res,
        stat if stat is not None else target,
        M, N, K, L, a.stride(0), a.stride(1), b.stride(0), b.stride(1), d.stride(0), d.stride(1),
        out.stride(0), out.stride(1), res.stride(0), res.stride(1), epi2.alpha,
        ACT=ACTS[act], GATED=bu is not None, HAS_B1=bias1 is not None, HAS_BU=biasu is not None,
        ACT2=ACTS[epi2.act], HAS_B2=bias2 is not None, HAS_RES=residual is not None and split == 1,
        ROWSTAT=ROWSTATS[epi2.rowstat] if split == 1 else 0, SPLIT_N=split, A_RESIDENT=K <= tiles.bk,
        EVEN_N=N % (tiles.bn * split) == 0, EVEN_K=K % tiles.bk == 0,
        PREC=dot_precision(a.dtype, exact_fp32), UPCAST=interpreting(), BM=tiles.bm, BN=tiles.bn, BK=tiles.bk,
        BL=tiles.bl,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if split > 1:
        _finish_partials(target, split, out, epi2, bias2, residual, stat)
    return out, stat


def act_pass(g, act: str, *, bias=None, u=None, biasu=None, out=None):
    """act(G + bias) [* (U + biasu)] for 2-D G, U (any strides) in one kernel; returns a new
    row-major tensor (or fills `out`)."""
    M, N = g.shape
    out = torch.empty((M, N), dtype=g.dtype, device=g.device) if out is None else out
    u_ = u if u is not None else g
    bm, bn = (16, 16) if interpreting() else (8, 256)  # 8 rows x 256 columns: 16-byte vector accesses
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    act_pass_kernel[grid](g, u_, out, bias if bias is not None else g, biasu if biasu is not None else g, M, N,
                          g.stride(0), g.stride(1), u_.stride(0), u_.stride(1), out.stride(0), out.stride(1),
                          ACT=ACTS[act], GATED=u is not None, HAS_BIAS=bias is not None, HAS_BIASU=biasu is not None,
                          BM=bm, BN=bn, num_warps=4)
    return out
