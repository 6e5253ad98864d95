"""GEMM with the fused epilogue, its tiles brought in by Hopper's bulk tensor copy engine (TMA).

The decode-sized chain halves (GPT-6.7B FFN at M=128: 128×4096·4096×16384, then 128×16384·16384×4096)
are weight streams: every byte of B is read once, and the time is bytes over HBM bandwidth only
if each SM keeps enough loads in flight. Tensor descriptors let one thread issue a whole tile's
copy into shared memory, completing on a barrier, instead of 128 threads computing addresses and
issuing cp.async; the pipeliner keeps `num_stages` tiles in flight. Same epilogue as
`chain_kernels.gemm` (bias, act, gate, residual, cast, row stats; split-K partials).

Descriptors need 16-byte-aligned rows: A and B row-major with K and N multiples of 8 (bf16);
`tma_refusal` says when a call cannot use them. Out-of-range tile elements read as zero, so M and
N need not be multiples of the tiles; K must be a multiple of BK · split_k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .chain_kernels import (ACTS, ROWSTATS, Epilogue, GemmTiles, _finish_partials, _gemm_epilogue, _grouped_tile, _mma,
                            _stat_buffer, dot_precision, interpreting)


def tma_refusal(a: torch.Tensor, b: torch.Tensor, tiles: GemmTiles, bu: torch.Tensor | None = None) -> str | None:
    """Why the TMA GEMM cannot take these operands (None: it can)."""
    K = a.shape[1]
    for name, t in (("A", a), ("B", b), ("Bu", bu)):
        if t is None:
            continue
        if t.stride(1) != 1:
            return f"{name} is not row-major"
        if (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return f"{name}'s rows are not 16-byte aligned"
    if K % (tiles.bk * tiles.split_k):
        return f"K={K} is not a multiple of bk*split_k={tiles.bk * tiles.split_k}"
    if bu is not None and tiles.split_k > 1:
        return "a gated GEMM is not split over K: the gate needs whole sums"
    return None


@triton.jit
def gemm_tma_kernel(a_desc, b_desc, bu_desc, c_ptr, bias_ptr, biasu_ptr, res_ptr, stat_ptr,
                    M, N, K, scm, scn, srm, srn, alpha,
                    ACT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_BIASU: tl.constexpr,
                    HAS_RES: tl.constexpr, ROWSTAT: tl.constexpr, SPLIT_K: tl.constexpr, PREC: tl.constexpr,
                    UPCAST: tl.constexpr, STAGES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid_k = tl.program_id(1)
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    k_per = K // SPLIT_K
    k_lo = pid_k * k_per
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    accu = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_lo + k_per, BK, num_stages=STAGES):
        a = a_desc.load([pid_m * BM, k0])
        acc = _mma(a, b_desc.load([k0, pid_n * BN]), acc, PREC, UPCAST)
        if GATED:
            accu = _mma(a, bu_desc.load([k0, pid_n * BN]), accu, PREC, UPCAST)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    _gemm_epilogue(acc, accu, offs_m, offs_n, pid_k, M, N, c_ptr, scm, scn, bias_ptr, biasu_ptr, res_ptr, srm, srn,
                   stat_ptr, alpha, ACT, GATED, HAS_BIAS, HAS_BIASU, HAS_RES, ROWSTAT, SPLIT_K)


def gemm_tma(a, b, *, epi: Epilogue = Epilogue(), bias=None, bu=None, biasu=None, residual=None, out_dtype=None,
             tiles: GemmTiles = GemmTiles(), exact_fp32: bool = False):
    """C = epi(A·B) [gated: act(A·B + bias) * (A·Bu + biasu)] with TMA tile loads.
    Returns (C, row statistic or None); raises ValueError when `tma_refusal` objects."""
    refusal = tma_refusal(a, b, tiles, bu)
    if refusal:
        raise ValueError(refusal)
    if epi.row_scale or epi.pro_act != "none":
        raise ValueError("the TMA GEMM has no prologue: tiles go from memory to the tensor cores untouched")
    M, K = a.shape
    N = b.shape[1]
    out = torch.empty((M, N), dtype=out_dtype or a.dtype, device=a.device)
    stat = _stat_buffer(M, epi.rowstat, a.device)
    split = tiles.split_k
    target = torch.empty((split, M, N), dtype=torch.float32, device=a.device) if split > 1 else out
    res = residual if residual is not None else out
    a_desc = TensorDescriptor.from_tensor(a, [tiles.bm, tiles.bk])
    b_desc = TensorDescriptor.from_tensor(b, [tiles.bk, tiles.bn])
    bu_desc = TensorDescriptor.from_tensor(bu, [tiles.bk, tiles.bn]) if bu is not None else b_desc
    grid = (triton.cdiv(M, tiles.bm) * triton.cdiv(N, tiles.bn), split)
    gemm_tma_kernel[grid](
        a_desc, b_desc, bu_desc, target, bias if bias is not None else a, biasu if biasu is not None else a,
        res, stat if stat is not None else target, M, N, K, out.stride(0), out.stride(1), res.stride(0),
        res.stride(1), epi.alpha,
        ACT=ACTS[epi.act], GATED=bu is not None, HAS_BIAS=bias is not None, HAS_BIASU=biasu is not None,
        HAS_RES=residual is not None and split == 1, ROWSTAT=ROWSTATS[epi.rowstat] if split == 1 else 0,
        SPLIT_K=split, PREC=dot_precision(a.dtype, exact_fp32), UPCAST=interpreting(), STAGES=tiles.num_stages,
        BM=tiles.bm, BN=tiles.bn, BK=tiles.bk, GROUP_M=tiles.group_m, num_warps=tiles.num_warps)
    if split > 1:
        _finish_partials(target, split, out, epi, bias, residual, stat)
    return out, stat
