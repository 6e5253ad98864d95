"""The chain E = act(A·B)·D as one Hopper kernel written in Gluon (the kernel's code is in
wgmma_kernel.py; this module plans, checks and launches it): weights in shared memory,
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

SMEM_BYTES = 227 * 1024          # an H100/H200 SM's shared memory for one block
GLUON_ACTS = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}

# log2 Φ(-u) on [0, 9], minimax of degree 6 (highest power first), fp32 coefficients. Φ's relative
# error is at most 4.1e-4 for x > -9, a tenth of a bf16 rounding step (3.9e-3): h = GELU(acc) is
# rounded to 16 bits before the second GEMM, so the degree-10 fit of chain_kernels._normal_cdf (fp32
# accuracy, 10 FMAs) buys nothing here and costs four FMAs per element, where the activation, not
# the tensor cores, bounds the memory-bound chains. tests/targets/gpu/test_chain_wgmma.py checks it.
PHI16_COEFFICIENTS = (9.992875675379764e-06, -0.0003530318499542773, 0.00526978587731719, -0.04456448554992676,
                      -0.47152072191238403, -1.1444188356399536, -1.000583529472351)

# The chain kernel's h = GELU(acc) in packed half precision, two elements per instruction
# (wgmma_kernel._gelu_pairs_asm): log2 Φ(-u), u = |x|, by a cubic evaluated in f16x2, fitted to the
# GELU's error in bf16 rounding steps (not to log2 Φ: where GELU is tiny, its error does not count).
# The leading coefficient is negative, so past the fit (u > 4) p only falls, to -inf at u = inf, and
# 2^p underflows to 0: no clamp. Against float64, emulated over x in [-9, 12]: mean 0.44 and at most
# 2.8 bf16 steps of |GELU| where |GELU| > 1e-3 (eager, which rounds A·B to bf16 before its GELU: mean
# 0.64, at most 7.5). 14 instructions per pair of elements, two of them MUFU ex2; the degree-4 fit on
# [0, 5.5] with a clamp took 16 (65536×64→256→64: 17.0-17.4 µs against 17.8, H100).
PHI_PAIRS_COEFFICIENTS = (-0.01594003239937775, -0.535585631431372, -1.0899659684582512, -1.0105377217930211)


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


def tma_rows(t: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
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
    if any(tma_rows(t) is None for t in (a, b, d)) or tma_rows(a)[1]:
        return "A must be row-major, B and D row-major or transposed row-major, with 16-byte-aligned rows (TMA)"
    return shape_refusal(a.shape[1], d.shape[0], d.shape[1], tiles, act)


def kernel_module():
    """The Gluon kernel module; raises ValueError with the reason when this Triton has no usable
    Gluon (the plans then go without the wgmma kind, see `gluon_refusal`)."""
    try:
        from . import wgmma_kernel
    except (ImportError, AttributeError, TypeError) as err:
        raise ValueError(f"Triton's Gluon API is not usable here: {type(err).__name__}: {err}") from err
    return wgmma_kernel


def gluon_refusal() -> str | None:
    """None when the Gluon kernel module imports; else why not."""
    try:
        kernel_module()
    except ValueError as err:
        return str(err)
    return None


def compile_for_sm90(M: int, K: int, N: int, L: int, tiles: WgmmaTiles, act: str = "gelu",
                     bias: bool = False, linear_weights: bool = False) -> dict:
    """Compile the kernel for sm_90 without a GPU (Triton's ptxas): registers, spilled bytes and
    shared memory per program, from the cubin. Tests use it on CPU machines."""
    a = torch.empty(M, K, dtype=torch.bfloat16)
    if linear_weights:  # nn.Linear layouts: B = W1.t(), D = W2.t()
        b, d = torch.empty(N, K, dtype=torch.bfloat16).t(), torch.empty(L, N, dtype=torch.bfloat16).t()
    else:
        b, d = torch.empty(K, N, dtype=torch.bfloat16), torch.empty(N, L, dtype=torch.bfloat16)
    out = torch.empty(M, L)
    args, meta = launch_args(a, b, d, out.to(torch.bfloat16), torch.empty(N) if bias else None, act, tiles)
    return compile_gluon_sm90(kernel_module().chain_wgmma_kernel, args, meta, tiles.num_warps, ints=("M",))


def compile_gluon_sm90(fn, args: tuple, meta: dict, num_warps: int, ints: tuple[str, ...]) -> dict:
    """Compile a Gluon kernel for sm_90 with Triton's ptxas (no GPU needed): registers, spilled
    bytes and shared memory per program, read from the cubin. `ints` name the i32 scalar arguments."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    signature = {name: mangle_type(value) for name, value in zip(fn.arg_names, args)}
    signature.update({name: "i32" for name in ints})
    signature.update({name: "constexpr" for name in meta})
    kernel = triton.compile(GluonASTSource(fn, signature, meta), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps})
    return cubin_resources(kernel)


def cubin_resources(kernel) -> dict:
    """Registers, spilled bytes and shared memory per program of a compiled kernel, from its cubin."""
    import subprocess
    import tempfile

    import triton

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = f"{triton.__path__[0]}/backends/nvidia/bin/cuobjdump"
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    field = {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}
    return {"registers": field["REG"], "spilled": field["STACK"] + field["LOCAL"], "smem": kernel.metadata.shared}


def launch_args(a, b, d, out, bias1, act: str, tiles: WgmmaTiles) -> tuple[tuple, dict]:
    """The kernel's arguments (also what tests compile for sm_90 without a GPU)."""
    M, K = a.shape
    N, L = d.shape
    (b_rows, b_t), (d_rows, d_t) = tma_rows(b), tma_rows(d)
    _descriptor = kernel_module().descriptor
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
    kernel_module().chain_wgmma_kernel[grid](*args, **meta)
    return out
