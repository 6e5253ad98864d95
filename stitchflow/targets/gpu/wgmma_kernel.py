"""Gluon code of the Hopper chain kernel (see chain_wgmma.py, which plans and launches it).

Kept apart so that the rest of the gpu target never imports Triton's experimental Gluon API:
chain_wgmma imports this module on first use, and a Triton without it (or with another version
of it) only takes the wgmma plans away."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .chain_wgmma import PHI16_COEFFICIENTS, PHI_PAIRS_COEFFICIENTS

PHI16_TAIL = gl.constexpr(PHI16_COEFFICIENTS)


def _gelu_pairs_asm(out: str) -> str:
    """PTX for two GELUs at once (chain_wgmma.PHI_PAIRS_COEFFICIENTS): log2 Φ(-|x|) and its power of
    two in packed half precision (two lanes per instruction), x·Φ(x) = max(x, 0) - |x|·2^p in fp32,
    both results rounded into one 32-bit register of `out` (bf16x2 or f16x2), the layout the second
    wgmma reads. Operands: $1, $2 the two fp32 inputs, $0 the packed result. An infinite x gives NaN
    (inf·0 in the fp32 product)."""
    import numpy as np

    def pair(value: float) -> str:
        half = int(np.float16(value).view(np.uint16))
        return f"0x{half:04X}{half:04X}"

    c = PHI_PAIRS_COEFFICIENTS
    horner = "".join(f"mov.b32 c, {pair(ci)}; fma.rn.f16x2 p, p, u, c; " for ci in c[2:])
    return ("{ .reg .b32 xh, u, p, c, e; .reg .b16 e_lo, e_hi; .reg .f32 e0, e1, y0, y1, n0, n1; "
            "cvt.rn.f16x2.f32 xh, $2, $1; and.b32 u, xh, 0x7FFF7FFF; "
            f"mov.b32 c, {pair(c[0])}; mov.b32 p, {pair(c[1])}; fma.rn.f16x2 p, c, u, p; "
            f"{horner}ex2.approx.f16x2 e, p; mov.b32 {{e_lo, e_hi}}, e; cvt.f32.f16 e0, e_lo; cvt.f32.f16 e1, e_hi; "
            "max.f32 y0, $1, 0f00000000; max.f32 y1, $2, 0f00000000; abs.f32 n0, $1; abs.f32 n1, $2; "
            "neg.f32 n0, n0; neg.f32 n1, n1; fma.rn.f32 y0, n0, e0, y0; fma.rn.f32 y1, n1, e1, y1; "
            f"cvt.rn.{out}.f32 $0, y1, y0; }}")


GELU_PAIRS_BF16 = gl.constexpr(_gelu_pairs_asm("bf16x2"))
GELU_PAIRS_F16 = gl.constexpr(_gelu_pairs_asm("f16x2"))


@gluon.jit
def _activation(x, ACT: gl.constexpr):
    if ACT == 1:
        x = gl.maximum(x, 0.0)
    elif ACT == 2:  # GELU x·Φ(x), Φ to 16-bit resolution: Φ(-u) = 2^p(u), p of degree 6 (chain_wgmma.PHI16_COEFFICIENTS)
        u = gl.minimum(gl.abs(x), 9.0)
        p = u * PHI16_TAIL[0] + PHI16_TAIL[1]
        for i in gl.static_range(2, 7):
            p = p * u + PHI16_TAIL[i]
        x = gl.maximum(x, 0.0) - gl.abs(x) * gl.exp2(p)  # x≥0: x - x·Φ(-x); x<0: x·Φ(x)
    elif ACT == 3:  # 0.5·x·(1 + tanh(z)) with the SFU's tanh: one MUFU op per element
        z = x * (0.7978845608028654 + 0.035677408136300125 * x * x)
        t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [z], dtype=gl.float32, is_pure=True, pack=1)
        x = 0.5 * x + 0.5 * x * t
    elif ACT == 4:
        x = gl.fdiv(x, 1.0 + gl.exp2(-1.4426950408889634 * x))
    return x


@gluon.jit
def _chunk_h(acc1, bias1_ptr, c, ACT: gl.constexpr, HAS_B1: gl.constexpr, BN: gl.constexpr, h_layout: gl.constexpr,
             dtype: gl.constexpr):
    """h_c = act(acc1 + b1[c·BN:(c+1)·BN]) in 16 bits, laid out as the second wgmma's left operand."""
    if HAS_B1:
        cols = c * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc1.type.layout))
        acc1 = acc1 + gl.load(bias1_ptr + cols).to(gl.float32)[None, :]
    if ACT == 2 and dtype == gl.bfloat16:  # GELU two elements per instruction (see _gelu_pairs_asm)
        h = gl.inline_asm_elementwise(GELU_PAIRS_BF16, "=r,f,f", [acc1], dtype=gl.bfloat16, is_pure=True, pack=2)
    elif ACT == 2:
        h = gl.inline_asm_elementwise(GELU_PAIRS_F16, "=r,f,f", [acc1], dtype=gl.float16, is_pure=True, pack=2)
    else:
        h = _activation(acc1, ACT).to(dtype)
    return gl.convert_layout(h, h_layout)


@gluon.jit
def _operand(smem, i, TRANSPOSED: gl.constexpr):
    """Slot i of a weight ring as the wgmma's [K, N]-shaped right operand. A transposed slot holds
    rows of the row-major nn.Linear weight ([N, K]): wgmma reads it K-major, no copy."""
    slot = smem.index(i)
    if TRANSPOSED:
        slot = slot.permute((1, 0))
    return slot


@gluon.jit
def _resident_tile(a_tile, b_smem, d_smem, bias1_ptr, ACT: gl.constexpr, HAS_B1: gl.constexpr, BM: gl.constexpr,
                   BN: gl.constexpr, L: gl.constexpr, NCH: gl.constexpr, WARPS: gl.constexpr, B_T: gl.constexpr,
                   D_T: gl.constexpr):
    """E_tile = Σ_c act(A·B_c + b1_c)·D_c, every chunk of B and D resident in shared memory.
    Asynchronous wgmma: GEMM1 of chunk c+1 runs on the tensor cores during chunk c's activation."""
    mma1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BN, 16])
    mma2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, L, 16])
    h_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma2, k_width=2)
    acc2 = gl.zeros([BM, L], gl.float32, mma2)
    acc1 = warpgroup_mma(a_tile, _operand(b_smem, 0, B_T), gl.zeros([BM, BN], gl.float32, mma1), use_acc=False,
                         is_async=True)
    for c in gl.static_range(NCH):
        acc1 = warpgroup_mma_wait(num_outstanding=0 if c == 0 else 1, deps=[acc1])
        if c + 1 < NCH:
            nxt = warpgroup_mma(a_tile, _operand(b_smem, c + 1, B_T), gl.zeros([BM, BN], gl.float32, mma1),
                                use_acc=False, is_async=True)
        h = _chunk_h(acc1, bias1_ptr, c, ACT, HAS_B1, BN, h_layout, a_tile.dtype)
        acc2 = warpgroup_mma(h, _operand(d_smem, c, D_T), acc2, is_async=True)
        if c + 1 < NCH:
            acc1 = nxt
    return warpgroup_mma_wait(num_outstanding=0, deps=[acc2])


@gluon.jit
def _load_weights(b_desc, d_desc, b_smem, d_smem, bar, chunk, BN: gl.constexpr, B_T: gl.constexpr,
                  D_T: gl.constexpr):
    """Chunk `chunk` of B (K×BN; transposed: rows chunk·BN.. of W1 [N, K]) and of D (BN×L; transposed:
    columns of W2 [L, N]) into one ring slot, completing on `bar`."""
    mbarrier.expect(bar, b_desc.block_type.nbytes + d_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(b_desc, [chunk * BN, 0] if B_T else [0, chunk * BN], bar, b_smem)
    tma.async_copy_global_to_shared(d_desc, [0, chunk * BN] if D_T else [chunk * BN, 0], bar, d_smem)


@gluon.jit
def _streamed_tile(a_tile, b_smem, d_smem, w_bar, b_desc, d_desc, bias1_ptr, i, my_tiles, ACT: gl.constexpr,
                   HAS_B1: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, L: gl.constexpr, NCH: gl.constexpr,
                   W_STAGES: gl.constexpr, WARPS: gl.constexpr, B_T: gl.constexpr, D_T: gl.constexpr):
    """The same sum with B and D streamed chunk by chunk through a ring of W_STAGES shared-memory
    slots (weights too large to stay); chunk g = i·NCH + c of this program lives in slot g % W_STAGES."""
    mma1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BN, 16])
    mma2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, L, 16])
    h_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma2, k_width=2)
    acc2 = gl.zeros([BM, L], gl.float32, mma2)
    for c in gl.static_range(NCH):
        g = i * NCH + c
        ws = g % W_STAGES
        mbarrier.wait(w_bar.index(ws), (g // W_STAGES) & 1)
        acc1 = warpgroup_mma(a_tile, _operand(b_smem, ws, B_T), gl.zeros([BM, BN], gl.float32, mma1), use_acc=False)
        h = _chunk_h(acc1, bias1_ptr, c, ACT, HAS_B1, BN, h_layout, a_tile.dtype)
        acc2 = warpgroup_mma(h, _operand(d_smem, ws, D_T), acc2)
        gl.thread_barrier()  # every warp is done with this slot: fetch the chunk W_STAGES ahead into it
        nxt = g + W_STAGES
        if nxt < my_tiles * NCH:
            _load_weights(b_desc, d_desc, b_smem.index(ws), d_smem.index(ws), w_bar.index(ws), nxt % NCH, BN, B_T,
                          D_T)
    return acc2


@gluon.jit
def chain_wgmma_kernel(a_desc, b_desc, d_desc, o_desc, bias1_ptr, M,
                       K: gl.constexpr, N: gl.constexpr, L: gl.constexpr, ACT: gl.constexpr, HAS_B1: gl.constexpr,
                       BM: gl.constexpr, BN: gl.constexpr, A_STAGES: gl.constexpr, W_STAGES: gl.constexpr,
                       RESIDENT: gl.constexpr, B_T: gl.constexpr, D_T: gl.constexpr, num_warps: gl.constexpr):
    NCH: gl.constexpr = N // BN
    W_SLOTS: gl.constexpr = NCH if RESIDENT else W_STAGES
    dtype: gl.constexpr = a_desc.dtype
    a_smem = gl.allocate_shared_memory(dtype, [A_STAGES, BM, K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [W_SLOTS] + b_desc.block_type.shape, b_desc.layout)
    d_smem = gl.allocate_shared_memory(dtype, [W_SLOTS] + d_desc.block_type.shape, d_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [BM, L], o_desc.layout)
    a_bar = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
    w_bar = gl.allocate_shared_memory(gl.int64, [W_SLOTS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(A_STAGES):
        mbarrier.init(a_bar.index(s), count=1)
    for s in gl.static_range(W_SLOTS):
        mbarrier.init(w_bar.index(s), count=1)
    fence_async_shared()

    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    my_tiles = (gl.cdiv(M, BM) - pid + programs - 1) // programs
    for s in gl.static_range(A_STAGES):  # the first tiles' A, in flight before any math
        mbarrier.expect(a_bar.index(s), a_desc.block_type.nbytes, pred=s < my_tiles)
        tma.async_copy_global_to_shared(a_desc, [(pid + s * programs) * BM, 0], a_bar.index(s), a_smem.index(s),
                                        pred=s < my_tiles)
    for s in gl.static_range(W_SLOTS):  # resident: every chunk, once; streamed: the ring's first chunks
        _load_weights(b_desc, d_desc, b_smem.index(s), d_smem.index(s), w_bar.index(s), s % NCH, BN, B_T, D_T)
    if RESIDENT:
        for s in gl.static_range(NCH):
            mbarrier.wait(w_bar.index(s), 0)

    for i in range(my_tiles):
        slot = i % A_STAGES
        mbarrier.wait(a_bar.index(slot), (i // A_STAGES) & 1)
        if RESIDENT:
            acc2 = _resident_tile(a_smem.index(slot), b_smem, d_smem, bias1_ptr, ACT, HAS_B1, BM, BN, L, NCH,
                                  num_warps, B_T, D_T)
        else:
            acc2 = _streamed_tile(a_smem.index(slot), b_smem, d_smem, w_bar, b_desc, d_desc, bias1_ptr, i, my_tiles,
                                  ACT, HAS_B1, BM, BN, L, NCH, W_STAGES, num_warps, B_T, D_T)
        gl.thread_barrier()  # every warpgroup is done reading this A slot: refill it
        more = i + A_STAGES < my_tiles
        mbarrier.expect(a_bar.index(slot), a_desc.block_type.nbytes, pred=more)
        tma.async_copy_global_to_shared(a_desc, [(pid + (i + A_STAGES) * programs) * BM, 0], a_bar.index(slot),
                                        a_smem.index(slot), pred=more)
        tma.store_wait(0)  # the previous tile's E has left o_smem
        o_smem.store(acc2.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(o_desc, [(pid + i * programs) * BM, 0], o_smem)
    tma.store_wait(0)
    for s in gl.static_range(A_STAGES):
        mbarrier.invalidate(a_bar.index(s))
    for s in gl.static_range(W_SLOTS):
        mbarrier.invalidate(w_bar.index(s))


def descriptor(t, block: list[int]) -> TensorDescriptor:
    dtype = gl.bfloat16 if str(t.dtype) == "torch.bfloat16" else gl.float16
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dtype))
