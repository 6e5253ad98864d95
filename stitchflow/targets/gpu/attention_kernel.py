"""Block-sparse attention as one Triton kernel: O = softmax(t(Q·Kᵀ))·V, tiles driven by a tile list.

The score transform t is affine per element, t(s) = a[l, m]·s + b[l, m], or -inf where the mask
drops the position (attention.py derives a and b from the IR at compile time). `TilePlan` cuts the
(S_q, S_k) grid into BM×BN tiles and keeps, per query tile, only the key tiles that hold a kept
position, in CSR form: a *uniform* tile (every position kept, one a and one b) costs nothing beyond
dense attention; a *partial* tile (some positions dropped, or a and b vary) loads its a and b from a
compact [n_partial, BM, BN] store. Dropped tiles are never visited, so the work is the mask's
density at tile granularity.

Each program owns one query tile of one batch entry and walks its key tiles with the online
softmax (running max and sum, in base 2: log2(e) is folded into a and b). A row that keeps no
position ends as 0/0 = NaN, as eager's softmax over a row of -inf does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .chain_kernels import _mma, interpreting

LOG2E = 1.0 / math.log(2.0)
MAX_BATCH_AXES = 3


@dataclass(frozen=True)
class AttentionTiles:
    bm: int = 64
    bn: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __str__(self) -> str:
        return f"bm{self.bm} bn{self.bn} w{self.num_warps} s{self.num_stages}"


@dataclass(frozen=True, eq=False)
class TilePlan:
    """Which key tiles each query tile visits, and with which coefficients (tensors on one device)."""

    tiles: AttentionTiles
    start: torch.Tensor      # int32 [n_qtiles + 1]: CSR offsets into the tile list
    column: torch.Tensor     # int32 [n_tiles]: key-tile index
    slot: torch.Tensor       # int32 [n_tiles]: row of the partial store, -1 for a uniform tile
    scale: torch.Tensor      # fp32 [n_tiles]: a·log2(e) of a uniform tile
    shift: torch.Tensor      # fp32 [n_tiles]: b·log2(e) of a uniform tile
    partial_a: torch.Tensor  # fp32 [n_partial, BM, BN]
    partial_b: torch.Tensor  # fp32 [n_partial, BM, BN], -inf where dropped

    @property
    def visited(self) -> int:
        return int(self.column.numel())

    @property
    def partial(self) -> int:
        return int(self.partial_a.shape[0])

    def to(self, device) -> "TilePlan":
        moved = {f: getattr(self, f).to(device) for f in ("start", "column", "slot", "scale", "shift",
                                                           "partial_a", "partial_b")}
        return TilePlan(self.tiles, **moved)

    def __str__(self) -> str:
        n_q = self.start.numel() - 1
        return f"{self.tiles}: {self.visited} tiles visited over {n_q} query tiles ({self.partial} partial)"


def tile_plan(a: torch.Tensor, b: torch.Tensor, tiles: AttentionTiles) -> TilePlan:
    """Cut the coefficient maps a, b ([S_q, S_k] fp32, b = -inf where dropped) into tiles."""
    s_q, s_k = a.shape
    bm, bn = tiles.bm, tiles.bn
    n_q, n_k = -(-s_q // bm), -(-s_k // bn)
    pa = torch.zeros(n_q * bm, n_k * bn, dtype=torch.float32)
    pb = torch.full((n_q * bm, n_k * bn), float("-inf"), dtype=torch.float32)
    pa[:s_q, :s_k], pb[:s_q, :s_k] = a, b
    # rows past S_q are never stored: give them the first row's coefficients so that they do not
    # turn a uniform tile partial
    pa[s_q:, :], pb[s_q:, :] = pa[s_q - 1], pb[s_q - 1]
    ta = pa.view(n_q, bm, n_k, bn).permute(0, 2, 1, 3)  # [n_q, n_k, bm, bn]
    tb = pb.view(n_q, bm, n_k, bn).permute(0, 2, 1, 3)
    dropped = torch.isneginf(tb)
    visited = ~dropped.flatten(2).all(-1)
    first_a, first_b = ta[..., :1, :1], tb[..., :1, :1]
    uniform = (~dropped.flatten(2).any(-1)) & (ta == first_a).flatten(2).all(-1) & (tb == first_b).flatten(2).all(-1)
    qi, ki = visited.nonzero(as_tuple=True)  # row-major: key tiles ascending within a query tile
    partial = visited & ~uniform
    slot = torch.full(visited.shape, -1, dtype=torch.int32)
    slot[partial] = torch.arange(int(partial.sum()), dtype=torch.int32)
    start = torch.zeros(n_q + 1, dtype=torch.int32)
    start[1:] = torch.cumsum(visited.sum(1), 0).to(torch.int32)
    return TilePlan(
        tiles, start, ki.to(torch.int32), slot[qi, ki].contiguous(),
        (first_a[qi, ki, 0, 0] * LOG2E).contiguous(), (first_b[qi, ki, 0, 0] * LOG2E).contiguous(),
        (ta[partial] * LOG2E).contiguous(), (tb[partial] * LOG2E).contiguous())


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, pa_ptr, pb_ptr,
                      start_ptr, column_ptr, slot_ptr, scale_ptr, shift_ptr,
                      E1, E2,
                      sq0, sq1, sq2, sq_l, sq_d,
                      sk0, sk1, sk2, sk_m, sk_d,
                      sv0, sv1, sv2, sv_m, sv_e,
                      so0, so1, so2, so_l, so_e,
                      S_Q, S_K, D, DV,
                      BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                      PREC: tl.constexpr, P_LOW: tl.constexpr, UPCAST: tl.constexpr):
    qt = tl.program_id(0)
    batch = tl.program_id(1)
    b2 = batch % E2
    b1 = (batch // E2) % E1
    b0 = batch // (E1 * E2)
    rows = qt * BM + tl.arange(0, BM)
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    cols = tl.arange(0, BN)
    q_at = q_ptr + b0 * sq0 + b1 * sq1 + b2 * sq2
    k_at = k_ptr + b0 * sk0 + b1 * sk1 + b2 * sk2
    v_at = v_ptr + b0 * sv0 + b1 * sv1 + b2 * sv2
    q = tl.load(q_at + rows[:, None] * sq_l + d[None, :] * sq_d,
                mask=(rows[:, None] < S_Q) & (d[None, :] < D), other=0.0)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    tile_offsets = tl.arange(0, BM)[:, None] * BN + cols[None, :]
    for t in range(tl.load(start_ptr + qt), tl.load(start_ptr + qt + 1)):
        key = tl.load(column_ptr + t) * BN + cols
        k = tl.load(k_at + key[None, :] * sk_m + d[:, None] * sk_d,
                    mask=(key[None, :] < S_K) & (d[:, None] < D), other=0.0)
        s = _mma(q, k, tl.zeros([BM, BN], tl.float32), PREC, UPCAST)
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            a = tl.load(pa_ptr + slot * (BM * BN) + tile_offsets)
            b = tl.load(pb_ptr + slot * (BM * BN) + tile_offsets)
            s = tl.where(b == float("-inf"), float("-inf"), s * a + b)
        else:
            s = s * tl.load(scale_ptr + t) + tl.load(shift_ptr + t)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing kept yet
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_at + key[:, None] * sv_m + e[None, :] * sv_e,
                    mask=(key[:, None] < S_K) & (e[None, :] < DV), other=0.0)
        if P_LOW:
            p = p.to(v.dtype)
        acc = _mma(p, v, acc * alpha[:, None], PREC, UPCAST)
        m_i = m_new
    out = acc / l_i[:, None]
    o_at = o_ptr + b0 * so0 + b1 * so1 + b2 * so2
    tl.store(o_at + rows[:, None] * so_l + e[None, :] * so_e, out.to(o_ptr.dtype.element_ty),
             mask=(rows[:, None] < S_Q) & (e[None, :] < DV))


@dataclass(frozen=True)
class Operand:
    """A tensor read as [batch axes (up to three)..., seq, feature]: element strides and an offset."""

    tensor: torch.Tensor
    offset: int
    batch_strides: tuple[int, ...]
    seq_stride: int
    feature_stride: int


def launch(q: Operand, k: Operand, v: Operand, out: torch.Tensor, batch: tuple[int, ...],
           plan: TilePlan, s_q: int, s_k: int, d: int, dv: int, precision: str) -> torch.Tensor:
    """Run the kernel; `out` is [*batch, S_q, dv] with any strides."""
    pad = MAX_BATCH_AXES - len(batch)
    extents = (1,) * pad + tuple(batch)
    strides = [(0,) * pad + tuple(op.batch_strides) for op in (q, k, v)]
    strides.append((0,) * pad + tuple(out.stride()[:-2]))
    tiles = plan.tiles
    n_q = plan.start.numel() - 1
    grid = (n_q, max(1, math.prod(extents)))
    # the kernel only takes base pointers: a one-element view at the operand's first element
    views = [op.tensor.as_strided((1,), (1,), op.tensor.storage_offset() + op.offset) for op in (q, k, v)]
    _attention_kernel[grid](
        *views, out, plan.partial_a, plan.partial_b,
        plan.start, plan.column, plan.slot, plan.scale, plan.shift,
        extents[1], extents[2],
        *strides[0], q.seq_stride, q.feature_stride,
        *strides[1], k.seq_stride, k.feature_stride,
        *strides[2], v.seq_stride, v.feature_stride,
        *strides[3], out.stride(-2), out.stride(-1),
        s_q, s_k, d, dv,
        BM=tiles.bm, BN=tiles.bn, BD=max(16, triton.next_power_of_2(d)), BDV=max(16, triton.next_power_of_2(dv)),
        PREC=precision, P_LOW=v.tensor.dtype in (torch.float16, torch.bfloat16), UPCAST=interpreting(),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out
