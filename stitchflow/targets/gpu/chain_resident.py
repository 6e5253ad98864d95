"""A persistent chain kernel for chains whose weights are small: E = epi2(act(A·B + b1)·D).

When K and L each fit one tile (K ≤ 128, L ≤ 256: the memory-bound chains, 65536×64→256→64),
the chain is a stream over row tiles of A with the same few kilobytes of weights for every tile.
`chain_kernels.chain_kernel` launches one program per row tile and pays each program's start-up
(the first A load's full latency, the weights' first trip through L2) hundreds of times. Here a
grid of about one program per SM walks the row tiles; the loop over tiles is the innermost
dynamic loop, so Triton's pipeliner prefetches the next tiles' A while the current one computes
(`num_stages`), and the N chunks are unrolled (N is a compile-time constant: chains are
shape-static). Optionally the weights are loaded once per program and kept in registers
(`weights_in_registers`, one N chunk only) instead of re-read from L1/L2 for every tile.

K, N, L are compile-time constants, so masks along them fold away when they equal the tiles and
the loads along K stay 16 bytes wide; rows are masked, so any M works.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .chain_kernels import ACTS, ROWSTATS, Epilogue, _act, _finish_tile, _mma, _stat_buffer, dot_precision, interpreting

MAX_K = 128
MAX_L = 256


@dataclass(frozen=True)
class ResidentTiles:
    bm: int = 128
    bn: int = 128
    num_warps: int = 8
    num_stages: int = 1             # > 1: Triton's pipeliner stages every load of the tile loop, weights too
    weights_in_registers: bool = False
    programs_per_sm: int = 2
    prefetch: bool = True           # load the next tile's A into registers while this one computes
    transposed: bool = False        # E^T = D^T·act(B^T·A^T): the weights are register operands for every tile


def _tile(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def resident_refusal(K: int, N: int, L: int, tiles: ResidentTiles | None = None, gated: bool = False) -> str | None:
    """Why this kernel cannot run the shape (None: it can)."""
    if K > MAX_K:
        return f"K={K} > {MAX_K}: A's row tile would not fit registers whole"
    if L > MAX_L:
        return f"L={L} > {MAX_L}: the output row tile would not fit registers whole"
    if tiles is not None and tiles.weights_in_registers and N > tiles.bn:
        return "weights in registers need N in one chunk"
    if tiles is not None and tiles.transposed and (N > 256 or gated):
        return "the transposed kernel holds B^T and D^T whole in registers: N <= 256, not gated"
    return None


@triton.jit
def _h_chunk(a, b_ptr, bu_ptr, bias1_ptr, biasu_ptr, sbk, sbn, offs_k, ns,
             K: tl.constexpr, N: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, HAS_B1: tl.constexpr,
             HAS_BU: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """h = act(A·B[:, ns] + b1) [* (A·Bu[:, ns] + bu)] for one chunk of N, in registers (fp32)."""
    n_ok = ns < N
    w_mask = (offs_k < K)[:, None] & n_ok[None, :]
    b_off = offs_k[:, None] * sbk + ns[None, :] * sbn
    acc = _mma(a, tl.load(b_ptr + b_off, mask=w_mask, other=0.0), tl.zeros((BM, BN), dtype=tl.float32), PREC, UPCAST)
    if HAS_B1:
        acc += tl.load(bias1_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    h = _act(acc, ACT)
    if GATED:
        up = _mma(a, tl.load(bu_ptr + b_off, mask=w_mask, other=0.0), tl.zeros((BM, BN), dtype=tl.float32),
                  PREC, UPCAST)
        if HAS_BU:
            up += tl.load(biasu_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        h = h * up
    return h


@triton.jit
def resident_chain_kernel(a_ptr, b_ptr, bu_ptr, d_ptr, out_ptr, bias1_ptr, biasu_ptr, bias2_ptr, res_ptr, stat_ptr,
                          M, sam, sak, sbk, sbn, sdn, sdl, som, sol, srm, srl, alpha2,
                          K: tl.constexpr, N: tl.constexpr, L: tl.constexpr,
                          ACT: tl.constexpr, GATED: tl.constexpr, HAS_B1: tl.constexpr, HAS_BU: tl.constexpr,
                          ACT2: tl.constexpr, HAS_B2: tl.constexpr, HAS_RES: tl.constexpr, ROWSTAT: tl.constexpr,
                          W_IN_REGS: tl.constexpr, PREFETCH: tl.constexpr, PREC: tl.constexpr,
                          UPCAST: tl.constexpr, STAGES: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BL: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs_k = tl.arange(0, BK)
    offs_l = tl.arange(0, BL)
    offs_n = tl.arange(0, BN)
    k_ok = offs_k < K
    l_ok = offs_l < L
    if W_IN_REGS:  # one chunk: B (and Bu) and D stay in registers for every tile this program takes
        w_mask = k_ok[:, None] & (offs_n < N)[None, :]
        b_res = tl.load(b_ptr + offs_k[:, None] * sbk + offs_n[None, :] * sbn, mask=w_mask, other=0.0)
        if GATED:
            bu_res = tl.load(bu_ptr + offs_k[:, None] * sbk + offs_n[None, :] * sbn, mask=w_mask, other=0.0)
        d_res = tl.load(d_ptr + offs_n[:, None] * sdn + offs_l[None, :] * sdl,
                        mask=(offs_n < N)[:, None] & l_ok[None, :], other=0.0)
    row = tl.arange(0, BM)
    a_off = row[:, None] * sam + offs_k[None, :] * sak
    if PREFETCH:  # the first tile's A; each iteration then loads the next tile's before computing
        a_next = tl.load(a_ptr + pid * BM * sam + a_off, mask=((pid * BM + row) < M)[:, None] & k_ok[None, :],
                         other=0.0)
    for tile in tl.range(pid, tl.cdiv(M, BM), programs, num_stages=STAGES):
        offs_m = tile * BM + row
        m_ok = offs_m < M
        if PREFETCH:  # register double-buffering by hand: the load is in flight during this tile's math
            a = a_next
            nxt = tile + programs
            a_next = tl.load(a_ptr + nxt * BM * sam + a_off, mask=((nxt * BM + row) < M)[:, None] & k_ok[None, :],
                             other=0.0)
        else:
            a = tl.load(a_ptr + tile * BM * sam + a_off, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc2 = tl.zeros((BM, BL), dtype=tl.float32)
        if W_IN_REGS:
            acc = _mma(a, b_res, tl.zeros((BM, BN), dtype=tl.float32), PREC, UPCAST)
            if HAS_B1:
                acc += tl.load(bias1_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            h = _act(acc, ACT)
            if GATED:
                up = _mma(a, bu_res, tl.zeros((BM, BN), dtype=tl.float32), PREC, UPCAST)
                if HAS_BU:
                    up += tl.load(biasu_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
                h = h * up
            acc2 = _mma(h.to(d_ptr.dtype.element_ty), d_res, acc2, PREC, UPCAST)
        else:
            for c in tl.static_range(0, N, BN):  # unrolled: the tile loop stays the pipelined innermost loop
                acc2 = _chunk_step(acc2, a, c, b_ptr, bu_ptr, d_ptr, bias1_ptr, biasu_ptr, sbk, sbn, sdn, sdl, offs_k,
                                   offs_n, offs_l, K, N, L, ACT, GATED, HAS_B1, HAS_BU, PREC, UPCAST, BM, BN)
        _finish_tile(acc2, offs_m, offs_l, M, L, out_ptr, som, sol, bias2_ptr, res_ptr, srm, srl, stat_ptr, alpha2,
                     ACT2, HAS_B2, HAS_RES, ROWSTAT)


@triton.jit
def _chunk_step(acc2, a, c, b_ptr, bu_ptr, d_ptr, bias1_ptr, biasu_ptr, sbk, sbn, sdn, sdl, offs_k, offs_n, offs_l,
                K: tl.constexpr, N: tl.constexpr, L: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
                HAS_B1: tl.constexpr, HAS_BU: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr):
    """acc2 += h_c·D[c:c+BN, :] for the chunk of N at c; h is rounded to the weights' dtype, as the
    unfused program stores it."""
    ns = c + offs_n
    h = _h_chunk(a, b_ptr, bu_ptr, bias1_ptr, biasu_ptr, sbk, sbn, offs_k, ns, K, N, ACT, GATED, HAS_B1, HAS_BU, PREC,
                 UPCAST, BM, BN)
    d = tl.load(d_ptr + ns[:, None] * sdn + offs_l[None, :] * sdl, mask=(ns < N)[:, None] & (offs_l < L)[None, :],
                other=0.0)
    return _mma(h.to(d_ptr.dtype.element_ty), d, acc2, PREC, UPCAST)


@triton.jit
def transposed_chain_kernel(a_ptr, b_ptr, d_ptr, out_ptr, bias1_ptr, bias2_ptr, res_ptr, stat_ptr,
                            M, sam, sak, sbk, sbn, sdn, sdl, som, sol, srm, srl, alpha2,
                            K: tl.constexpr, N: tl.constexpr, L: tl.constexpr, ACT: tl.constexpr,
                            HAS_B1: tl.constexpr, ACT2: tl.constexpr, HAS_B2: tl.constexpr, HAS_RES: tl.constexpr,
                            ROWSTAT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BL: tl.constexpr):
    """The chain computed transposed: h^T = act(B^T·A^T + b1), E^T = D^T·h^T. The tensor cores take
    their left operand from registers, so B^T and D^T, loaded once, serve every row tile without
    being staged through shared memory again; only A^T and h^T pass through it. One chunk: N ≤ BN."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs_k = tl.arange(0, BK)
    offs_n = tl.arange(0, BN)
    offs_l = tl.arange(0, BL)
    n_ok = offs_n < N
    bt = tl.load(b_ptr + offs_n[:, None] * sbn + offs_k[None, :] * sbk, mask=n_ok[:, None] & (offs_k < K)[None, :],
                 other=0.0)
    dt = tl.load(d_ptr + offs_l[:, None] * sdl + offs_n[None, :] * sdn, mask=(offs_l < L)[:, None] & n_ok[None, :],
                 other=0.0)
    if HAS_B1:
        b1 = tl.load(bias1_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    for tile in tl.range(pid, tl.cdiv(M, BM), programs, num_stages=STAGES):
        offs_m = tile * BM + tl.arange(0, BM)
        at = tl.load(a_ptr + offs_k[:, None] * sak + offs_m[None, :] * sam,
                     mask=(offs_k < K)[:, None] & (offs_m < M)[None, :], other=0.0)
        ht = _mma(bt, at, tl.zeros((BN, BM), dtype=tl.float32), PREC, UPCAST)
        if HAS_B1:
            ht += b1[:, None]
        ht = _act(ht, ACT)
        et = _mma(dt, ht.to(d_ptr.dtype.element_ty), tl.zeros((BL, BM), dtype=tl.float32), PREC, UPCAST)
        _finish_tile(tl.trans(et), offs_m, offs_l, M, L, out_ptr, som, sol, bias2_ptr, res_ptr, srm, srl, stat_ptr,
                     alpha2, ACT2, HAS_B2, HAS_RES, ROWSTAT)


def _sm_count(device) -> int:
    if interpreting() or device.type != "cuda":
        return 4  # under the interpreter: few programs, so each walks several tiles
    return torch.cuda.get_device_properties(device).multi_processor_count


def resident_chain(a, b, d, *, act: str = "none", bias1=None, bu=None, biasu=None, epi2: Epilogue = Epilogue(),
                   bias2=None, residual=None, out_dtype=None, tiles: ResidentTiles = ResidentTiles(),
                   exact_fp32: bool = False, programs: int | None = None):
    """E = epi2(h·D), h = act(A·B + bias1) [* (A·Bu + biasu)], persistent over row tiles of A.
    Returns (E, row statistic or None)."""
    M, K = a.shape
    N, L = d.shape
    refusal = resident_refusal(K, N, L, tiles, bu is not None)
    if tiles.transposed and a.element_size() == 4:  # seen on the H200: NaNs with fp32 (tf32) operands
        refusal = "the transposed kernel takes 16-bit operands only"
    if refusal:
        raise ValueError(refusal)
    out = torch.empty((M, L), dtype=out_dtype or a.dtype, device=a.device)
    stat = _stat_buffer(M, epi2.rowstat, a.device)
    res = residual if residual is not None else out
    bn = min(tiles.bn, _tile(N))
    row_tiles = triton.cdiv(M, tiles.bm)
    grid = (max(1, min(row_tiles, programs or _sm_count(a.device) * tiles.programs_per_sm)),)
    if tiles.transposed:
        transposed_chain_kernel[grid](
            a, b, d, out, bias1 if bias1 is not None else a, bias2 if bias2 is not None else a, res,
            stat if stat is not None else out, M, a.stride(0), a.stride(1), b.stride(0), b.stride(1), d.stride(0),
            d.stride(1), out.stride(0), out.stride(1), res.stride(0), res.stride(1), epi2.alpha,
            K=K, N=N, L=L, ACT=ACTS[act], HAS_B1=bias1 is not None, ACT2=ACTS[epi2.act], HAS_B2=bias2 is not None,
            HAS_RES=residual is not None, ROWSTAT=ROWSTATS[epi2.rowstat], PREC=dot_precision(a.dtype, exact_fp32),
            UPCAST=interpreting(), STAGES=tiles.num_stages, BM=tiles.bm, BN=_tile(N), BK=_tile(K), BL=_tile(L),
            num_warps=tiles.num_warps)
        return out, stat
    resident_chain_kernel[grid](
        a, b, bu if bu is not None else b, d, out, bias1 if bias1 is not None else a,
        biasu if biasu is not None else a, bias2 if bias2 is not None else a, res,
        stat if stat is not None else out,
        M, a.stride(0), a.stride(1), b.stride(0), b.stride(1), d.stride(0), d.stride(1),
        out.stride(0), out.stride(1), res.stride(0), res.stride(1), epi2.alpha,
        K=K, N=N, L=L, ACT=ACTS[act], GATED=bu is not None, HAS_B1=bias1 is not None, HAS_BU=biasu is not None,
        ACT2=ACTS[epi2.act], HAS_B2=bias2 is not None, HAS_RES=residual is not None,
        ROWSTAT=ROWSTATS[epi2.rowstat], W_IN_REGS=tiles.weights_in_registers, PREFETCH=tiles.prefetch,
        PREC=dot_precision(a.dtype, exact_fp32), UPCAST=interpreting(), STAGES=tiles.num_stages,
        BM=tiles.bm, BN=bn, BK=_tile(K), BL=_tile(L), num_warps=tiles.num_warps)
    return out, stat
