"""Gluon code of the weight-streaming GEMM (see stream_gemm.py, which plans and launches it).

C = act(A·B + bias) for a short A (decode and small-batch rows) and a long B that is read once:
a ring of STAGES shared-memory slots, each filled by one TMA copy of A's and B's K-slices that
completes on its own barrier, and asynchronous wgmma that keeps one MMA in flight while the next
slot lands. Split-K programs write fp32 partial tiles to a workspace and count themselves in on a
per-tile semaphore; the last to arrive sums the others' partials, applies the epilogue and resets
the semaphore, so a split-K GEMM needs no second kernel."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

from .wgmma_kernel import _activation, _operand


@gluon.jit
def _load_slices(a_desc, b_desc, a_slot, b_slot, bar, m0, n0, k, B_T: gl.constexpr, pred):
    """A[m0:, k:k+BK] and B[k:k+BK, n0:] (transposed: rows n0.. of the [N, K] weight) into one slot."""
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [m0, k], bar, a_slot, pred=pred)
    tma.async_copy_global_to_shared(b_desc, [n0, k] if B_T else [k, n0], bar, b_slot, pred=pred)


@gluon.jit
def _epilogue_store(acc, c_ptr, bias_ptr, rows, cols, M, N, ACT: gl.constexpr, HAS_BIAS: gl.constexpr):
    if HAS_BIAS:
        acc = acc + gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)[None, :]
    out = _activation(acc, ACT).to(c_ptr.dtype.element_ty)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    gl.store(c_ptr + rows[:, None] * N + cols[None, :], out, mask=mask)


@gluon.jit
def stream_gemm_kernel(a_desc, b_desc, c_ptr, bias_ptr, ws_ptr, count_ptr, M, N,
                       K_SPLIT: gl.constexpr, ACT: gl.constexpr, HAS_BIAS: gl.constexpr, BM: gl.constexpr,
                       BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                       B_T: gl.constexpr, num_warps: gl.constexpr):
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    split = gl.program_id(2)
    m0 = pid_m * BM
    n0 = pid_n * BN
    k0 = split * K_SPLIT
    KT: gl.constexpr = K_SPLIT // BK
    dtype: gl.constexpr = a_desc.dtype
    a_smem = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()
    for p in gl.static_range(STAGES - 1):  # STAGES-1 slices in flight before the first MMA
        _load_slices(a_desc, b_desc, a_smem.index(p), b_smem.index(p), bars.index(p), m0, n0, k0 + p * BK, B_T,
                     p < KT)

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, mma)
    for kt in range(KT):
        slot = kt % STAGES
        mbarrier.wait(bars.index(slot), (kt // STAGES) & 1)
        acc = warpgroup_mma(a_smem.index(slot), _operand(b_smem, slot, B_T), acc, is_async=True)
        # one MMA stays in flight: the one of slice kt-1 is done, so its slot takes slice kt+STAGES-1
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
        gl.thread_barrier()
        nxt = kt + STAGES - 1
        ns = nxt % STAGES
        _load_slices(a_desc, b_desc, a_smem.index(ns), b_smem.index(ns), bars.index(ns), m0, n0, k0 + nxt * BK,
                     B_T, nxt < KT)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    if SPLIT == 1:
        _epilogue_store(acc, c_ptr, bias_ptr, rows, cols, M, N, ACT, HAS_BIAS)
    else:
        # workspace [SPLIT, M_tiles·BM, N_tiles·BN] in fp32: whole tiles, no masks
        padded_n = gl.num_programs(0) * BN
        stride = gl.num_programs(1) * BM * padded_n
        offsets = rows[:, None] * padded_n + cols[None, :]
        gl.store(ws_ptr + split * stride + offsets, acc)
        gl.thread_barrier()  # every thread's partial is written before the count says so
        tile = pid_m * gl.num_programs(0) + pid_n
        arrived = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:  # the last split: the others' partials are in, sum them
            for other in gl.static_range(SPLIT):
                if other != split:
                    acc += gl.load(ws_ptr + other * stride + offsets, cache_modifier=".cg")
            _epilogue_store(acc, c_ptr, bias_ptr, rows, cols, M, N, ACT, HAS_BIAS)
            gl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next call
