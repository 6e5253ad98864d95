"""The weight-streaming GEMM for short A: C = act(A·B + bias) as one Hopper kernel written in
Gluon (its code is in stream_gemm_kernel.py; this module plans, checks and launches it).

Why: the decode-sized chain halves (GPT-6.7B FFN at M=128: 128×4096·4096×16384, then
128×16384·16384×4096) read every byte of B once, so their time is B's bytes over the bandwidth
the kernel keeps in flight. cuBLAS and the Triton TMA GEMM stream at about 0.74-0.76 of the copy
rate on an H100 (BENCHMARKS.md, round three). Here each program keeps STAGES-1 slices of A and B
in flight through TMA into a shared-memory ring with one asynchronous wgmma behind them, and
split-K programs finish on a semaphore instead of a second kernel (see the kernel's docstring).

Gluon has no interpreter: the kernel runs only on a Hopper GPU; CPU tests compile it for sm_90.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .chain_wgmma import GLUON_ACTS, SMEM_BYTES, compile_gluon_sm90, kernel_module, tma_rows


@dataclass(frozen=True)
class StreamTiles:
    bm: int = 128
    bn: int = 128
    bk: int = 64
    stages: int = 6
    split_k: int = 1
    num_warps: int = 4

    def __str__(self) -> str:
        return f"stream {self.bm}x{self.bn}x{self.bk} s{self.stages} splitk{self.split_k} w{self.num_warps}"


def smem_bytes(tiles: StreamTiles) -> int:
    return tiles.stages * (tiles.bm + tiles.bn) * tiles.bk * 2 + 1024


def shape_refusal(M: int, N: int, K: int, tiles: StreamTiles, act: str) -> str | None:
    """Why the kernel cannot take a GEMM of this shape (None: it can)."""
    if act not in GLUON_ACTS:
        return f"activation {act!r} is not in the stream GEMM's epilogue"
    if any(v & (v - 1) for v in (tiles.bm, tiles.bn, tiles.bk)) or tiles.bn > 256 or tiles.bk > 256:
        return "tiles must be powers of two with bn and bk at most 256 (one TMA box, one wgmma N)"
    if tiles.num_warps % 4 or tiles.bm % (16 * tiles.num_warps):
        return (f"bm={tiles.bm} must be a multiple of {16 * tiles.num_warps} rows: whole warpgroups of 4 warps, "
                "16 rows per warp")
    per_thread = tiles.bm * tiles.bn // (tiles.num_warps * 32)
    if per_thread > (64 if tiles.split_k > 1 else 128):  # ptxas: 255 registers at these bounds, spills past them
        return (f"{per_thread} accumulator elements per thread do not fit registers"
                f"{' next to the split-K finish' if tiles.split_k > 1 else ''}: more warps or smaller tiles")
    if K % (tiles.bk * tiles.split_k):
        return f"K={K} is not a multiple of bk*split_k={tiles.bk * tiles.split_k}"
    if N % 8:
        return f"N={N} is not a multiple of 8 (16-byte rows for TMA)"
    if smem_bytes(tiles) > SMEM_BYTES:
        return f"{tiles.stages} stages of {tiles.bm}x{tiles.bk} and {tiles.bk}x{tiles.bn} do not fit shared memory"
    return None


def stream_refusal(a: torch.Tensor, b: torch.Tensor, tiles: StreamTiles, act: str) -> str | None:
    """Why the kernel cannot run this call (None: it can)."""
    if not (a.is_cuda and torch.cuda.get_device_capability(a.device)[0] == 9):
        return "needs a Hopper GPU (sm_90): Gluon's wgmma kernels have no interpreter"
    if not all(t.dtype in (torch.bfloat16, torch.float16) and t.dtype == a.dtype for t in (a, b)):
        return "operands must share one 16-bit dtype"
    if tma_rows(a) is None or tma_rows(a)[1] or tma_rows(b) is None:
        return "A must be row-major, B row-major or transposed row-major, with 16-byte-aligned rows (TMA)"
    return shape_refusal(a.shape[0], b.shape[1], a.shape[1], tiles, act)


_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device, split: int, m_tiles: int, n_tiles: int, bm: int, bn: int):
    """fp32 partials and zeroed per-tile semaphores for split-K. The kernel leaves the semaphores at
    zero, so outside CUDA-graph capture one workspace per (device, stream, tiling) serves every call;
    under capture each graph gets its own (its memory belongs to the graph's pool)."""
    def fresh():
        return (torch.empty(split * m_tiles * bm * n_tiles * bn, dtype=torch.float32, device=device),
                torch.zeros(m_tiles * n_tiles, dtype=torch.int32, device=device))
    if torch.cuda.is_current_stream_capturing():
        return fresh()
    key = (str(device), torch.cuda.current_stream(device).cuda_stream, split, m_tiles, n_tiles, bm, bn)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = fresh()
    return _WORKSPACES[key]


def launch_args(a, b, out, bias, act: str, tiles: StreamTiles, workspace=None) -> tuple[tuple, dict, tuple]:
    """The kernel's arguments and grid (also what tests compile for sm_90 without a GPU)."""
    M, K = a.shape
    N = b.shape[1]
    b_rows, b_t = tma_rows(b)
    _descriptor = kernel_module().descriptor
    grid = (-(-N // tiles.bn), -(-M // tiles.bm), tiles.split_k)
    ws, count = workspace if workspace is not None else (out, out)
    args = (_descriptor(a, [tiles.bm, tiles.bk]),
            _descriptor(b_rows, [tiles.bn, tiles.bk] if b_t else [tiles.bk, tiles.bn]),
            out, bias if bias is not None else out, ws, count, M, N)
    meta = dict(K_SPLIT=K // tiles.split_k, ACT=GLUON_ACTS[act], HAS_BIAS=bias is not None, BM=tiles.bm,
                BN=tiles.bn, BK=tiles.bk, STAGES=tiles.stages, SPLIT=tiles.split_k, B_T=b_t,
                num_warps=tiles.num_warps)
    return args, meta, grid


def stream_gemm(a, b, *, act: str = "none", bias=None, tiles: StreamTiles = StreamTiles()) -> torch.Tensor:
    """act(A·B + bias) on a Hopper GPU in A's dtype (fp32 accumulation); raises ValueError on refusal."""
    refusal = stream_refusal(a, b, tiles, act)
    if refusal:
        raise ValueError(refusal)
    M, N = a.shape[0], b.shape[1]
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    workspace = None
    if tiles.split_k > 1:
        workspace = _workspace(a.device, tiles.split_k, -(-M // tiles.bm), -(-N // tiles.bn), tiles.bm, tiles.bn)
    args, meta, grid = launch_args(a, b, out, bias, act, tiles, workspace)
    stream_module().stream_gemm_kernel[grid](*args, **meta)
    return out


def stream_module():
    kernel_module()  # raises ValueError with the reason when Gluon is not usable
    from . import stream_gemm_kernel
    return stream_gemm_kernel


def compile_for_sm90(M: int, N: int, K: int, tiles: StreamTiles, act: str = "gelu", bias: bool = False,
                     linear_weights: bool = False) -> dict:
    """Compile for sm_90 without a GPU: registers, spilled bytes and shared memory per program."""
    a = torch.empty(M, K, dtype=torch.bfloat16)
    b = torch.empty(N, K, dtype=torch.bfloat16).t() if linear_weights else torch.empty(K, N, dtype=torch.bfloat16)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    ws = (torch.empty(1), torch.empty(1, dtype=torch.int32)) if tiles.split_k > 1 else None
    args, meta, _ = launch_args(a, b, out, torch.empty(N) if bias else None, act, tiles, ws)
    return compile_gluon_sm90(stream_module().stream_gemm_kernel, args, meta, tiles.num_warps, ints=("M", "N"))
