"""The chain E = act(A·B)·D as one Hopper kernel written in Gluon: weights in shared memory,
A and E moved by the bulk tensor copy engine (TMA), both GEMMs on warpgroup MMA (wgmma).

Why not the Triton kernels of `chain_resident`: for the memory-bound chains (65536×64→256→64)
the tensor-core part alone took 18.9 µs there against a 5.3 µs floor, because Triton stages B
and D from global memory through registers into shared memory again for every row tile. Here
each program copies B and D into shared memory once (when they fit: `resident`) or streams
their N-chunks through a ring of shared-memory stages fed by TMA; A's row tiles arrive through
a ring of `a_stages` TMA buffers while the current tile computes; h stays in registers as the
second wgmma's left operand, so the M×N intermediate never leaves the SM. Several programs per
SM (`programs_per_sm`) let one program's activation math run while another's MMAs use the
tensor cores.

Gluon has no interpreter: these kernels run only on a Hopper GPU. On CPU machines the tests
compile them for sm_90 (`compile_for_sm90`, Triton's own ptxas) and check resource use; the
device checks in `bench/chains_checks.py` compare them with eager.

Measured on an H100 (scripts/wgmma_probe.py, docs/chains_notes.md): 65536×64→256→64 with GELU in
20.4 µs against 53.7 for torch.compile and 30.2 for the Triton resident kernel; the same kernel
without an activation takes 14.3 µs, so the activation's ALU work still adds rather than overlaps.
A warp-specialised variant (a TMA loader warp, two or three consumer warpgroups sharing one copy
of the weights) was correct but slower (24.4 µs), and was removed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

SMEM_BYTES = 227 * 1024          # an H100/H200 SM's shared memory for one block
GLUON_ACTS = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}

# log2 Φ(-u) on [0, 9], minimax of degree 6 (highest power first), fp32 coefficients. Φ's relative
# error is at most 4.1e-4 for x > -9, a tenth of a bf16 rounding step (3.9e-3): h = GELU(acc) is
# rounded to 16 bits before the second GEMM, so the degree-10 fit of chain_kernels._normal_cdf (fp32
# accuracy, 10 FMAs) buys nothing here and costs four FMAs per element, where the activation, not
# the tensor cores, bounds the memory-bound chains. tests/targets/gpu/test_chain_wgmma.py checks it.
PHI16_TAIL = gl.constexpr((9.992875675379764e-06, -0.0003530318499542773, 0.00526978587731719, -0.04456448554992676,
                           -0.47152072191238403, -1.1444188356399536, -1.000583529472351))


@dataclass(frozen=True)
class WgmmaTiles:
    bm: int = 64
    bn: int = 128                  # chunk of the intermediate (N) computed and consumed at once
    num_warps: int = 4             # 4: one warpgroup, wgmma M=64 per warpgroup
    a_stages: int = 2
    w_stages: int = 2              # ring of weight chunks when B and D do not stay resident
    programs_per_sm: int = 2

    def __str__(self) -> str:
        return (f"wgmma bm{self.bm} bn{self.bn} w{self.num_warps} a{self.a_stages} ws{self.w_stages} "
                f"x{self.programs_per_sm}/SM")


def smem_bytes(K: int, N: int, L: int, tiles: WgmmaTiles, resident: bool) -> int:
    chunks = N // tiles.bn if resident else tiles.w_stages
    weights = chunks * (K * tiles.bn + tiles.bn * L) * 2
    return weights + tiles.a_stages * tiles.bm * K * 2 + tiles.bm * L * 2 + 1024


def is_resident(K: int, N: int, L: int, tiles: WgmmaTiles) -> bool:
    """Weights stay in shared memory when they fit next to the A ring for `programs_per_sm` programs."""
    return smem_bytes(K, N, L, tiles, True) * tiles.programs_per_sm <= SMEM_BYTES


def shape_refusal(K: int, N: int, L: int, tiles: WgmmaTiles, act: str, gated: bool = False,
                  elt: int = 2) -> str | None:
    """Why this kernel cannot run a chain of this shape (None: it can)."""
    if gated:
        return "gated chains (two GEMM1 operands) are not in the wgmma chain kernel"
    if act not in GLUON_ACTS:
        return f"activation {act!r} is not in the wgmma chain kernel"
    if elt != 2:
        return "16-bit operands only (wgmma bf16/fp16 with fp32 accumulation)"
    pow2 = all(v & (v - 1) == 0 for v in (K, L, tiles.bm, tiles.bn))
    if not pow2 or K < 16 or K > 256 or L < 16 or L > 256:
        return f"K={K} and L={L} must be powers of two in 16..256 (one TMA box, one wgmma N)"
    if tiles.bm != 16 * tiles.num_warps:
        return f"bm={tiles.bm} must be 16 rows per warp ({tiles.num_warps} warps)"
    if N % tiles.bn:
        return f"N={N} is not a multiple of the chunk bn={tiles.bn}"
    if smem_bytes(K, N, L, tiles, False) * tiles.programs_per_sm > SMEM_BYTES:
        return "the A ring and two weight chunks do not fit shared memory"
    return None


def _tma_rows(t: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """(the row-major tensor TMA reads, whether it is t transposed), or None when neither t nor t.T
    is row-major with 16-byte-aligned rows. nn.Linear's weight arrives as w.t(): transposed."""
    for base, transposed in ((t, False), (t.t(), True)):
        if base.stride(1) == 1 and (base.stride(0) * base.element_size()) % 16 == 0 and base.data_ptr() % 16 == 0:
            return base, transposed
    return None


def wgmma_refusal(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, tiles: WgmmaTiles, act: str) -> str | None:
    """Why this kernel cannot run the call (None: it can)."""
    if not (a.is_cuda and torch.cuda.get_device_capability(a.device)[0] == 9):
        return "needs a Hopper GPU (sm_90): Gluon's wgmma kernels have no interpreter"
    if not all(t.dtype in (torch.bfloat16, torch.float16) and t.dtype == a.dtype for t in (a, b, d)):
        return "operands must share one 16-bit dtype"
    if any(_tma_rows(t) is None for t in (a, b, d)) or _tma_rows(a)[1]:
        return "A must be row-major, B and D row-major or transposed row-major, with 16-byte-aligned rows (TMA)"
    return shape_refusal(a.shape[1], d.shape[0], d.shape[1], tiles, act)


def compile_for_sm90(M: int, K: int, N: int, L: int, tiles: WgmmaTiles, act: str = "gelu",
                     bias: bool = False, linear_weights: bool = False) -> dict:
    """Compile the kernel for sm_90 without a GPU (Triton's ptxas): registers, spilled bytes and
    shared memory per program, from the cubin. Tests use it on CPU machines."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    a = torch.empty(M, K, dtype=torch.bfloat16)
    if linear_weights:  # nn.Linear layouts: B = W1.t(), D = W2.t()
        b, d = torch.empty(N, K, dtype=torch.bfloat16).t(), torch.empty(L, N, dtype=torch.bfloat16).t()
    else:
        b, d = torch.empty(K, N, dtype=torch.bfloat16), torch.empty(N, L, dtype=torch.bfloat16)
    out = torch.empty(M, L)
    args, meta = launch_args(a, b, d, out.to(torch.bfloat16), torch.empty(N) if bias else None, act, tiles)
    names = list(chain_wgmma_kernel.arg_names)
    signature = {name: mangle_type(value) for name, value in zip(names, args)}
    signature["M"] = "i32"
    signature.update({name: "constexpr" for name in meta})
    kernel = triton.compile(GluonASTSource(chain_wgmma_kernel, signature, meta), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": tiles.num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = f"{triton.__path__[0]}/backends/nvidia/bin/cuobjdump"
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    field = {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}
    return {"registers": field["REG"], "spilled": field["STACK"] + field["LOCAL"], "smem": kernel.metadata.shared}


@gluon.jit
def _activation(x, ACT: gl.constexpr):
    if ACT == 1:
        x = gl.maximum(x, 0.0)
    elif ACT == 2:  # GELU x·Φ(x), Φ to 16-bit resolution: Φ(-u) = 2^p(u), p of degree 6 (see PHI16_TAIL)
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
    return gl.convert_layout(_activation(acc1, ACT).to(dtype), h_layout)


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


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dtype))


def launch_args(a, b, d, out, bias1, act: str, tiles: WgmmaTiles) -> tuple[tuple, dict]:
    """The kernel's arguments (also what tests compile for sm_90 without a GPU)."""
    M, K = a.shape
    N, L = d.shape
    (b_rows, b_t), (d_rows, d_t) = _tma_rows(b), _tma_rows(d)
    args = (_descriptor(a, [tiles.bm, K]), _descriptor(b_rows, [tiles.bn, K] if b_t else [K, tiles.bn]),
            _descriptor(d_rows, [L, tiles.bn] if d_t else [tiles.bn, L]), _descriptor(out, [tiles.bm, L]),
            bias1 if bias1 is not None else a, M)
    meta = dict(K=K, N=N, L=L, ACT=GLUON_ACTS[act], HAS_B1=bias1 is not None, BM=tiles.bm, BN=tiles.bn,
                A_STAGES=tiles.a_stages, W_STAGES=tiles.w_stages, RESIDENT=is_resident(K, N, L, tiles),
                B_T=b_t, D_T=d_t, num_warps=tiles.num_warps)
    return args, meta


def chain_wgmma(a, b, d, *, act: str = "gelu", bias1=None, tiles: WgmmaTiles = WgmmaTiles(),
                programs: int | None = None):
    """E = act(A·B + bias1)·D on a Hopper GPU, the intermediate in registers; raises ValueError on refusal."""
    refusal = wgmma_refusal(a, b, d, tiles, act)
    if refusal:
        raise ValueError(refusal)
    out = torch.empty((a.shape[0], d.shape[1]), dtype=a.dtype, device=a.device)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    grid = (max(1, min(-(-a.shape[0] // tiles.bm), programs or sms * tiles.programs_per_sm)),)
    args, meta = launch_args(a, b, d, out, bias1, act, tiles)
    chain_wgmma_kernel[grid](*args, **meta)
    return out
