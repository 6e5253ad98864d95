"""Block-sparse attention as one Triton kernel: O = softmax(t(Q·Kᵀ))·V, tiles driven by a tile list.

The score transform t is affine, t(s) = a·s + b[l, m], with one a for the whole attention and
b = -inf where the mask drops the position (attention.py derives a and b from the IR at compile
time). `TilePlan` cuts the (S_q, S_k) grid into BM×BN tiles and keeps, per query tile, only the key
tiles that hold a kept position: a *uniform* tile (all kept, one b) costs what dense attention
costs; a *partial* tile loads b per position. Dropped tiles are never visited, so the work is the
mask's density at tile granularity.

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
    """Which key tiles each query tile visits, and with which offsets (tensors on one device).

    The score transform is s·a + b with one a for the whole attention (`scale`, log2(e) folded in).
    A *uniform* tile (every position kept, one b) adds its `shift`; a *partial* tile (some positions
    dropped, or b varies) loads b per position from `offsets` (-inf where dropped). The kernel walks
    a query tile's partial tiles, then its uniform ones, in two loops, so that the uniform tiles,
    most of a block mask's, pay nothing per position beyond dense attention."""

    tiles: AttentionTiles
    scale: float             # a·log2(e)
    start: torch.Tensor      # int32 [n_qtiles, 3]: where a query tile's partial tiles start, its uniform ones, the end
    column: torch.Tensor     # int32 [n_tiles]: key-tile index, ascending within each kind of a query tile
    slot: torch.Tensor       # int32 [n_tiles]: row of `offsets` (a partial tile), 0 (a uniform one)
    shift: torch.Tensor      # fp32 [n_tiles]: b·log2(e) of a uniform tile
    offsets: torch.Tensor    # fp32 [n_partial, BM, BN]: b·log2(e) per position, -inf where dropped

    @property
    def visited(self) -> int:
        return int(self.column.numel())

    @property
    def partial(self) -> int:
        return int(self.offsets.shape[0])

    def to(self, device) -> "TilePlan":
        moved = {f: getattr(self, f).to(device) for f in ("start", "column", "slot", "shift", "offsets")}
        return TilePlan(self.tiles, self.scale, **moved)

    def __str__(self) -> str:
        return (f"{self.tiles}: {self.visited} tiles visited over {self.start.shape[0]} query tiles "
                f"({self.partial} partial)")


def tile_plan(scale: float, b: torch.Tensor, tiles: AttentionTiles) -> TilePlan:
    """Cut the offset map b ([S_q, S_k] fp32, -inf where dropped) into tiles; a = `scale` everywhere."""
    s_q, s_k = b.shape
    bm, bn = tiles.bm, tiles.bn
    n_q, n_k = -(-s_q // bm), -(-s_k // bn)
    pb = torch.full((n_q * bm, n_k * bn), float("-inf"), dtype=torch.float32)
    pb[:s_q, :s_k] = b
    # rows past S_q are never stored: give them the last row's offsets so that they do not turn a
    # uniform tile partial
    pb[s_q:, :] = pb[s_q - 1]
    tb = pb.view(n_q, bm, n_k, bn).permute(0, 2, 1, 3)  # [n_q, n_k, bm, bn]
    dropped = torch.isneginf(tb).flatten(2)
    visited = ~dropped.all(-1)
    first = tb[..., :1, :1]
    uniform = ~dropped.any(-1) & (tb == first).flatten(2).all(-1)
    partial = visited & ~uniform
    # per query tile: partial tiles, then uniform ones, columns ascending within each; unvisited last
    order = torch.where(partial, 0, torch.where(uniform, 1, 2)) * n_k + torch.arange(n_k)
    ki = order.argsort(-1)
    qi = torch.arange(n_q)[:, None].expand(n_q, n_k)
    take = visited.gather(-1, ki)
    qi, ki = qi[take], ki[take]
    is_partial = partial[qi, ki]
    slot = torch.zeros(len(qi), dtype=torch.int32)
    slot[is_partial] = torch.arange(int(is_partial.sum()), dtype=torch.int32)
    counts = torch.stack([partial.sum(-1), uniform.sum(-1)], -1)
    start = torch.zeros(n_q, 3, dtype=torch.int64)
    start[:, 1:] = counts.cumsum(-1)
    start += (visited.sum(-1).cumsum(0) - visited.sum(-1))[:, None]
    shift = torch.where(is_partial, 0.0, first[qi, ki, 0, 0])
    return TilePlan(tiles, scale * LOG2E, start.to(torch.int32).contiguous(), ki.to(torch.int32).contiguous(),
                    slot, (shift * LOG2E).contiguous(), (tb[qi[is_partial], ki[is_partial]] * LOG2E).contiguous())


@triton.jit
def _load(ptrs, rows_ok, cols_ok, EVEN_ROWS: tl.constexpr, EVEN_COLS: tl.constexpr):
    """A tile load masked only along the axes that can run past the tensor: a mask that varies along
    the contiguous axis with a bound known only at run time keeps Triton from vectorising the load."""
    if EVEN_ROWS and EVEN_COLS:
        tile = tl.load(ptrs)
    elif EVEN_ROWS:
        tile = tl.load(ptrs, mask=cols_ok, other=0.0)
    elif EVEN_COLS:
        tile = tl.load(ptrs, mask=rows_ok, other=0.0)
    else:
        tile = tl.load(ptrs, mask=rows_ok & cols_ok, other=0.0)
    return tile


@triton.jit
def _visit(t, q, m_i, l_i, acc, k_at, v_at, kb_at, column_ptr, slot_ptr, shift_ptr, offsets_ptr, scale, kscale,
           cols, d, e, in_tile, sk_m, sk_d, sv_m, sv_e, skb_m, S_K, D, DV,
           BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, P_LOW: tl.constexpr, UPCAST: tl.constexpr,
           EVEN_K: tl.constexpr, EVEN_D: tl.constexpr, PARTIAL: tl.constexpr, HAS_KB: tl.constexpr):
    """One key tile of the online softmax (base 2); HAS_KB adds the call's per-key bias, times kscale."""
    key = tl.load(column_ptr + t) * BN + cols
    k = _load(k_at + key[None, :] * sk_m + d[:, None] * sk_d, d[:, None] < D, key[None, :] < S_K, EVEN_D, EVEN_K)
    s = _mma(q, k, tl.zeros([BM, BN], tl.float32), PREC, UPCAST)
    if PARTIAL:
        b = tl.load(offsets_ptr + tl.load(slot_ptr + t) * (BM * BN) + in_tile)
        s = tl.where(b == float("-inf"), float("-inf"), s * scale + b)
    else:
        s = s * scale + tl.load(shift_ptr + t)
    if HAS_KB:
        s += tl.load(kb_at + key * skb_m, mask=key < S_K, other=0.0).to(tl.float32)[None, :] * kscale
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if PARTIAL or HAS_KB:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing kept yet
    else:  # every position kept: the row maximum is finite
        m_use = m_new
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load(v_at + key[:, None] * sv_m + e[None, :] * sv_e, key[:, None] < S_K, e[None, :] < DV, EVEN_K, EVEN_D)
    if P_LOW:
        p = p.to(v.dtype)
    acc = _mma(p, v, acc * alpha[:, None], PREC, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, kb_ptr, offsets_ptr,
                      start_ptr, column_ptr, slot_ptr, shift_ptr, scale, kscale,
                      E1, E2,
                      sq0, sq1, sq2, sq_l, sq_d,
                      sk0, sk1, sk2, sk_m, sk_d,
                      sv0, sv1, sv2, sv_m, sv_e,
                      skb0, skb1, skb2, skb_m,
                      so0, so1, so2, so_l, so_e,
                      S_Q, S_K, D, DV,
                      BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                      PREC: tl.constexpr, P_LOW: tl.constexpr, UPCAST: tl.constexpr,
                      EVEN_Q: tl.constexpr, EVEN_K: tl.constexpr, EVEN_D: tl.constexpr, HAS_KB: tl.constexpr):
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
    kb_at = kb_ptr + b0 * skb0 + b1 * skb1 + b2 * skb2
    q = _load(q_at + rows[:, None] * sq_l + d[None, :] * sq_d, rows[:, None] < S_Q, d[None, :] < D, EVEN_Q, EVEN_D)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    in_tile = tl.arange(0, BM)[:, None] * BN + cols[None, :]
    first = tl.load(start_ptr + qt * 3)
    uniform = tl.load(start_ptr + qt * 3 + 1)
    end = tl.load(start_ptr + qt * 3 + 2)
    for t in range(first, uniform):
        m_i, l_i, acc = _visit(t, q, m_i, l_i, acc, k_at, v_at, kb_at, column_ptr, slot_ptr, shift_ptr,
                               offsets_ptr, scale, kscale, cols, d, e, in_tile, sk_m, sk_d, sv_m, sv_e, skb_m,
                               S_K, D, DV, BM, BN, PREC, P_LOW, UPCAST, EVEN_K, EVEN_D, True, HAS_KB)
    for t in range(uniform, end):
        m_i, l_i, acc = _visit(t, q, m_i, l_i, acc, k_at, v_at, kb_at, column_ptr, slot_ptr, shift_ptr,
                               offsets_ptr, scale, kscale, cols, d, e, in_tile, sk_m, sk_d, sv_m, sv_e, skb_m,
                               S_K, D, DV, BM, BN, PREC, P_LOW, UPCAST, EVEN_K, EVEN_D, False, HAS_KB)
    out = acc / l_i[:, None]
    o_at = o_ptr + b0 * so0 + b1 * so1 + b2 * so2
    o_ptrs = o_at + rows[:, None] * so_l + e[None, :] * so_e
    if EVEN_Q and EVEN_D:
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty))
    else:
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(rows[:, None] < S_Q) & (e[None, :] < DV))


@dataclass(frozen=True)
class Operand:
    """A tensor read as [batch axes (up to three)..., seq, feature]: element strides and an offset."""

    tensor: torch.Tensor
    offset: int
    batch_strides: tuple[int, ...]
    seq_stride: int
    feature_stride: int


def launch(q: Operand, k: Operand, v: Operand, out: torch.Tensor, batch: tuple[int, ...],
           plan: TilePlan, s_q: int, s_k: int, d: int, dv: int, precision: str,
           key_bias: Operand | None = None, bias_scale: float = 0.0) -> torch.Tensor:
    """Run the kernel; `out` is [*batch, S_q, dv] with any strides; `key_bias` (its seq stride over the
    keys) is added to the scores times `bias_scale`."""
    pad = MAX_BATCH_AXES - len(batch)
    extents = (1,) * pad + tuple(batch)
    bias = key_bias or Operand(plan.shift, 0, (0,) * len(batch), 0, 0)  # a dummy pointer without a bias
    strides = [(0,) * pad + tuple(op.batch_strides) for op in (q, k, v, bias)]
    strides.append((0,) * pad + tuple(out.stride()[:-2]))
    tiles = plan.tiles
    grid = (plan.start.shape[0], max(1, math.prod(extents)))
    bd, bdv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
    # the kernel only takes base pointers: a one-element view at the operand's first element
    views = [op.tensor.as_strided((1,), (1,), op.tensor.storage_offset() + op.offset) for op in (q, k, v, bias)]
    _attention_kernel[grid](
        *views[:3], out, views[3], plan.offsets, plan.start, plan.column, plan.slot, plan.shift, plan.scale,
        bias_scale * LOG2E,
        extents[1], extents[2],
        *strides[0], q.seq_stride, q.feature_stride,
        *strides[1], k.seq_stride, k.feature_stride,
        *strides[2], v.seq_stride, v.feature_stride,
        *strides[3], bias.seq_stride,
        *strides[4], out.stride(-2), out.stride(-1),
        s_q, s_k, d, dv,
        BM=tiles.bm, BN=tiles.bn, BD=bd, BDV=bdv,
        PREC=precision, P_LOW=v.tensor.dtype in (torch.float16, torch.bfloat16), UPCAST=interpreting(),
        EVEN_Q=s_q % tiles.bm == 0, EVEN_K=s_k % tiles.bn == 0, EVEN_D=bd == d and bdv == dv,
        HAS_KB=key_bias is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def compile_for_sm90(dtype: str, tiles: AttentionTiles, head_dim: int = 64, key_bias: bool = False) -> dict:
    """Compile the kernel for sm_90 with Triton's ptxas, no GPU needed (what CI can check of the
    configs the autotuner may pick): registers, spilled bytes, shared memory per program."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .chain_wgmma import cubin_resources

    tensors = {"q_ptr": "*" + dtype, "k_ptr": "*" + dtype, "v_ptr": "*" + dtype, "o_ptr": "*" + dtype,
               "kb_ptr": "*fp32", "offsets_ptr": "*fp32", "shift_ptr": "*fp32", "scale": "fp32", "kscale": "fp32",
               "start_ptr": "*i32", "column_ptr": "*i32", "slot_ptr": "*i32"}
    bd = max(16, triton.next_power_of_2(head_dim))
    meta = {"BM": tiles.bm, "BN": tiles.bn, "BD": bd, "BDV": bd, "PREC": "ieee" if dtype == "fp32" else "tf32",
            "P_LOW": dtype != "fp32", "UPCAST": False, "EVEN_Q": True, "EVEN_K": True, "EVEN_D": True,
            "HAS_KB": key_bias}
    signature = {name: tensors.get(name, "i32") for name in _attention_kernel.arg_names}
    signature.update({name: "constexpr" for name in meta})
    kernel = triton.compile(ASTSource(_attention_kernel, signature, meta), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    return cubin_resources(kernel)
