"""Block-sparse attention as one Triton kernel: O = softmax(t(Q·Kᵀ))·V, tiles driven by a tile list.

The score transform t is affine, t(s) = a·s + b[l, m], with one a for the whole attention and
b = -inf where the mask drops the position (attention.py derives a and b from the IR at compile
time). `TilePlan` cuts the (S_q, S_k) grid into BM×BN tiles and keeps, per query tile, only the key
tiles that hold a kept position: a *uniform* tile (all kept, one b) costs what dense attention
costs; a *partial* tile loads b per position. Dropped tiles are never visited, so the work is the
mask's density at tile granularity.

Each program owns one *work item* of one batch entry: a query tile's key tiles, or a run of at
most `chunk` of them, walked with the online softmax (running max and sum, in base 2: log2(e) is
folded into a and b). A query tile split into several items (a BigBird global row visits every key
tile, the others a handful) leaves each item's unnormalised sum and its running max and sum in a
scratch buffer, and `_merge_kernel` combines them, as flash-decoding does; without the split such a
row is the launch's critical path. Items are launched longest first, every batch entry's before the
next item's, so that the long ones do not start last. A row that keeps no position ends as
0/0 = NaN, as eager's softmax over a row of -inf does.
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
    chunk: int = 0  # at most this many key tiles per program (a longer query tile is split); 0: no split

    def __str__(self) -> str:
        split = f" c{self.chunk}" if self.chunk else ""
        return f"bm{self.bm} bn{self.bn} w{self.num_warps} s{self.num_stages}{split}"

    def chunked(self, chunk: int) -> "AttentionTiles":
        return AttentionTiles(self.bm, self.bn, self.num_warps, self.num_stages, chunk)


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
    items: torch.Tensor      # int32 [n_items, 5]: query tile, first partial, first uniform, end, scratch part
                             # (-1: the item is the whole query tile), longest first
    merges: torch.Tensor     # int32 [n_split, 3]: a split query tile, its first scratch part, its part count
    parts: int = 0           # scratch slots per batch entry: the items of split query tiles (host-side, so
                             # that a launch reads nothing back from the device, as a CUDA-graph capture needs)
    longest: int = 0         # the most key tiles one query tile visits

    @property
    def visited(self) -> int:
        return int(self.column.numel())

    @property
    def partial(self) -> int:
        return int(self.offsets.shape[0])

    def to(self, device) -> "TilePlan":
        moved = {f: getattr(self, f).to(device) for f in TENSOR_FIELDS}
        return TilePlan(self.tiles, self.scale, **moved, parts=self.parts, longest=self.longest)

    def __str__(self) -> str:
        split = f", {self.merges.shape[0]} split into {self.parts} programs" if self.merges.numel() else ""
        return (f"{self.tiles}: {self.visited} tiles visited over {self.start.shape[0]} query tiles "
                f"({self.partial} partial{split})")


TENSOR_FIELDS = ("start", "column", "slot", "shift", "offsets", "items", "merges")
CHUNKS = (4, 8, 16, 32)  # runs the autotuner tries for a plan whose longest query tile is longer


def chunk_options(plan: TilePlan) -> tuple[int, ...]:
    """Splits worth timing: none, and each run length shorter than the plan's longest query tile. Measured
    on an H100 (scripts/attention_split_probe.py): BigBird at S=4096 runs fastest with runs of 16-32 (its
    global rows visit all 64 key tiles, the others about 7), FuseFlow's S=1024 with runs of 4-8 (192
    programs otherwise leave SMs idle), a dense plan without a split."""
    return (0, *(c for c in CHUNKS if c < plan.longest))


def work_items(start: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(items, merges) of TilePlan: each query tile's tile list [first, end) cut into runs of at most
    `chunk` tiles (as even as possible; chunk 0 cuts nothing), longest run first."""
    rows, merges, part = [], [], 0
    for qt, (first, uniform, end) in enumerate(start.tolist()):
        n = end - first
        pieces = max(1, -(-n // chunk)) if chunk else 1
        if pieces == 1:
            rows.append((qt, first, uniform, end, -1))
            continue
        merges.append((qt, part, pieces))
        bounds = [first + n * i // pieces for i in range(pieces + 1)]
        for i in range(pieces):
            lo, hi = bounds[i], bounds[i + 1]
            rows.append((qt, lo, min(max(uniform, lo), hi), hi, part + i))
        part += pieces
    rows.sort(key=lambda r: (r[1] - r[3], r[0]))  # longest first (a stable LPT order)
    items = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)
    return items, torch.tensor(merges, dtype=torch.int32).reshape(-1, 3)


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
    items, merges = work_items(start, tiles.chunk)
    return TilePlan(tiles, scale * LOG2E, start.to(torch.int32).contiguous(), ki.to(torch.int32).contiguous(),
                    slot, (shift * LOG2E).contiguous(), (tb[qi[is_partial], ki[is_partial]] * LOG2E).contiguous(),
                    items, merges, int(merges[:, 2].sum()), int(visited.sum(-1).max()))


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
def _batch_offsets(batch, E1, E2, s0, s1, s2):
    """Element offset of a batch entry (its index over three axes of extents *, E1, E2)."""
    b2 = batch % E2
    b1 = (batch // E2) % E1
    b0 = batch // (E1 * E2)
    return b0 * s0 + b1 * s1 + b2 * s2


@triton.jit
def _store_out(o_at, out, rows, e, so_l, so_e, S_Q, DV, EVEN_Q: tl.constexpr, EVEN_D: tl.constexpr):
    o_ptrs = o_at + rows[:, None] * so_l + e[None, :] * so_e
    if EVEN_Q and EVEN_D:
        tl.store(o_ptrs, out.to(o_at.dtype.element_ty))
    else:
        tl.store(o_ptrs, out.to(o_at.dtype.element_ty), mask=(rows[:, None] < S_Q) & (e[None, :] < DV))


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, kb_ptr, offsets_ptr,
                      items_ptr, column_ptr, slot_ptr, shift_ptr, part_o_ptr, part_ml_ptr, scale, kscale,
                      NB, E1, E2, NPARTS,
                      sq0, sq1, sq2, sq_l, sq_d,
                      sk0, sk1, sk2, sk_m, sk_d,
                      sv0, sv1, sv2, sv_m, sv_e,
                      skb0, skb1, skb2, skb_m,
                      so0, so1, so2, so_l, so_e,
                      S_Q, S_K, D, DV,
                      BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                      PREC: tl.constexpr, P_LOW: tl.constexpr, UPCAST: tl.constexpr,
                      EVEN_Q: tl.constexpr, EVEN_K: tl.constexpr, EVEN_D: tl.constexpr, HAS_KB: tl.constexpr,
                      SPLIT: tl.constexpr):
    item = tl.program_id(0) // NB  # every batch entry's program of an item before the next item's: longest first
    batch = tl.program_id(0) % NB
    qt = tl.load(items_ptr + item * 5)
    first = tl.load(items_ptr + item * 5 + 1)
    uniform = tl.load(items_ptr + item * 5 + 2)
    end = tl.load(items_ptr + item * 5 + 3)
    rows = qt * BM + tl.arange(0, BM)
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    cols = tl.arange(0, BN)
    q_at = q_ptr + _batch_offsets(batch, E1, E2, sq0, sq1, sq2)
    k_at = k_ptr + _batch_offsets(batch, E1, E2, sk0, sk1, sk2)
    v_at = v_ptr + _batch_offsets(batch, E1, E2, sv0, sv1, sv2)
    kb_at = kb_ptr + _batch_offsets(batch, E1, E2, skb0, skb1, skb2)
    q = _load(q_at + rows[:, None] * sq_l + d[None, :] * sq_d, rows[:, None] < S_Q, d[None, :] < D, EVEN_Q, EVEN_D)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    in_tile = tl.arange(0, BM)[:, None] * BN + cols[None, :]
    for t in range(first, uniform):
        m_i, l_i, acc = _visit(t, q, m_i, l_i, acc, k_at, v_at, kb_at, column_ptr, slot_ptr, shift_ptr,
                               offsets_ptr, scale, kscale, cols, d, e, in_tile, sk_m, sk_d, sv_m, sv_e, skb_m,
                               S_K, D, DV, BM, BN, PREC, P_LOW, UPCAST, EVEN_K, EVEN_D, True, HAS_KB)
    for t in range(uniform, end):
        m_i, l_i, acc = _visit(t, q, m_i, l_i, acc, k_at, v_at, kb_at, column_ptr, slot_ptr, shift_ptr,
                               offsets_ptr, scale, kscale, cols, d, e, in_tile, sk_m, sk_d, sv_m, sv_e, skb_m,
                               S_K, D, DV, BM, BN, PREC, P_LOW, UPCAST, EVEN_K, EVEN_D, False, HAS_KB)
    # a whole query tile stores its output; one run of a split tile stores its own normalised output in
    # the scratch (the output's dtype) with its running max and sum, for _merge_kernel. One store for both,
    # its base and strides chosen as scalars: a branch per kind kept two copies of the accumulator's
    # registers, a select between two pointer tiles cost the stores their vector width (both spilled)
    item = tl.program_id(0) // NB  # the program's coordinates again, not held through the loops
    batch = tl.program_id(0) % NB
    qt = tl.load(items_ptr + item * 5)
    r = tl.arange(0, BM)
    out = (acc / l_i[:, None]).to(o_ptr.dtype.element_ty)
    base = o_ptr + _batch_offsets(batch, E1, E2, so0, so1, so2) + qt * BM * so_l
    if SPLIT:
        part = tl.load(items_ptr + item * 5 + 4)
        split = part >= 0
        slot = batch * NPARTS + part
        base = tl.where(split, part_o_ptr + slot * (BM * BDV), base)
        stride_l = tl.where(split, BDV, so_l)
        stride_e = tl.where(split, 1, so_e)
        tl.store(part_ml_ptr + slot * (2 * BM) + r, m_i, mask=split & (r >= 0))
        tl.store(part_ml_ptr + slot * (2 * BM) + BM + r, l_i, mask=split & (r >= 0))
    else:
        split = False
        stride_l = so_l
        stride_e = so_e
    o_ptrs = base + r[:, None] * stride_l + e[None, :] * stride_e
    if EVEN_Q and EVEN_D:
        tl.store(o_ptrs, out)
    else:
        tl.store(o_ptrs, out, mask=((qt * BM + r[:, None] < S_Q) & (e[None, :] < DV)) | split)


@triton.jit
def _merge_kernel(o_ptr, merges_ptr, part_o_ptr, part_ml_ptr, NB, E1, E2, NPARTS,
                  so0, so1, so2, so_l, so_e, S_Q, DV,
                  BM: tl.constexpr, BDV: tl.constexpr, EVEN_Q: tl.constexpr, EVEN_D: tl.constexpr):
    """A split query tile's output from its runs' outputs, each weighed by its sum of exponentials
    relative to the common maximum (base 2)."""
    pid = tl.program_id(0)
    j = pid // NB
    batch = pid % NB
    qt = tl.load(merges_ptr + j * 3)
    first = batch * NPARTS + tl.load(merges_ptr + j * 3 + 1)
    n = tl.load(merges_ptr + j * 3 + 2)
    r = tl.arange(0, BM)
    e = tl.arange(0, BDV)
    m = tl.full([BM], float("-inf"), tl.float32)
    for i in range(n):
        m = tl.maximum(m, tl.load(part_ml_ptr + (first + i) * (2 * BM) + r))
    m_use = tl.where(m == float("-inf"), 0.0, m)  # a row that keeps nothing: 0/0, NaN as eager
    l_sum = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    for i in range(n):
        w = tl.math.exp2(tl.load(part_ml_ptr + (first + i) * (2 * BM) + r) - m_use)
        w = w * tl.load(part_ml_ptr + (first + i) * (2 * BM) + BM + r)  # 0 for a run that kept nothing
        o = tl.load(part_o_ptr + (first + i) * (BM * BDV) + r[:, None] * BDV + e[None, :]).to(tl.float32)
        acc += tl.where(w[:, None] > 0, o * w[:, None], 0.0)  # such a run's own output is 0/0
        l_sum += w
    o_at = o_ptr + _batch_offsets(batch, E1, E2, so0, so1, so2)
    _store_out(o_at, acc / l_sum[:, None], qt * BM + r, e, so_l, so_e, S_Q, DV, EVEN_Q, EVEN_D)


@dataclass(frozen=True)
class Operand:
    """A tensor read as [batch axes (up to three)..., seq, feature]: element strides and an offset."""

    tensor: torch.Tensor
    offset: int
    batch_strides: tuple[int, ...]
    seq_stride: int
    feature_stride: int


def scratch(plan: TilePlan, n_batch: int, dv: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The split query tiles' runs' results: (outputs [n_batch·parts, BM, BDV] in the output's dtype,
    running max and sum [.., 2, BM] fp32)."""
    if not plan.parts:
        return None
    slots, bm = n_batch * plan.parts, plan.tiles.bm
    bdv = max(16, triton.next_power_of_2(dv))
    return (torch.empty(slots, bm, bdv, dtype=dtype, device=device),
            torch.empty(slots, 2, bm, dtype=torch.float32, device=device))


def launch(q: Operand, k: Operand, v: Operand, out: torch.Tensor, batch: tuple[int, ...],
           plan: TilePlan, s_q: int, s_k: int, d: int, dv: int, precision: str,
           key_bias: Operand | None = None, bias_scale: float = 0.0,
           parts: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Run the kernel (and the merge of split query tiles); `out` is [*batch, S_q, dv] with any strides;
    `key_bias` (its seq stride over the keys) is added to the scores times `bias_scale`; `parts`: the
    scratch of `scratch()` (allocated here when not given)."""
    pad = MAX_BATCH_AXES - len(batch)
    extents = (1,) * pad + tuple(batch)
    n_batch = max(1, math.prod(extents))
    bias = key_bias or Operand(plan.shift, 0, (0,) * len(batch), 0, 0)  # a dummy pointer without a bias
    strides = [(0,) * pad + tuple(op.batch_strides) for op in (q, k, v, bias)]
    out_strides = (0,) * pad + tuple(out.stride()[:-2])
    tiles = plan.tiles
    bd, bdv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
    if plan.parts and parts is None:
        parts = scratch(plan, n_batch, dv, out.dtype, out.device)
    part_o, part_ml = parts if plan.parts else (out, plan.shift)  # dummies when nothing is split
    even = {"EVEN_Q": s_q % tiles.bm == 0, "EVEN_D": bd == d and bdv == dv}
    # the kernel only takes base pointers: a one-element view at the operand's first element
    views = [op.tensor.as_strided((1,), (1,), op.tensor.storage_offset() + op.offset) for op in (q, k, v, bias)]
    _attention_kernel[(plan.items.shape[0] * n_batch,)](
        *views[:3], out, views[3], plan.offsets, plan.items, plan.column, plan.slot, plan.shift, part_o, part_ml,
        plan.scale, bias_scale * LOG2E,
        n_batch, extents[1], extents[2], plan.parts,
        *strides[0], q.seq_stride, q.feature_stride,
        *strides[1], k.seq_stride, k.feature_stride,
        *strides[2], v.seq_stride, v.feature_stride,
        *strides[3], bias.seq_stride,
        *out_strides, out.stride(-2), out.stride(-1),
        s_q, s_k, d, dv,
        BM=tiles.bm, BN=tiles.bn, BD=bd, BDV=bdv,
        PREC=precision, P_LOW=v.tensor.dtype in (torch.float16, torch.bfloat16), UPCAST=interpreting(),
        EVEN_K=s_k % tiles.bn == 0, HAS_KB=key_bias is not None, SPLIT=plan.parts > 0, **even,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if plan.parts:
        _merge_kernel[(plan.merges.shape[0] * n_batch,)](
            out, plan.merges, part_o, part_ml, n_batch, extents[1], extents[2], plan.parts,
            *out_strides, out.stride(-2), out.stride(-1), s_q, dv, BM=tiles.bm, BDV=bdv, **even,
            num_warps=4)
    return out


def compile_for_sm90(dtype: str, tiles: AttentionTiles, head_dim: int = 64, key_bias: bool = False,
                     split: bool = False) -> dict:
    """Compile the kernel for sm_90 with Triton's ptxas, no GPU needed (what CI can check of the
    configs the autotuner may pick): registers, spilled bytes, shared memory per program."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .chain_wgmma import cubin_resources

    tensors = {"q_ptr": "*" + dtype, "k_ptr": "*" + dtype, "v_ptr": "*" + dtype, "o_ptr": "*" + dtype,
               "kb_ptr": "*fp32", "offsets_ptr": "*fp32", "shift_ptr": "*fp32", "scale": "fp32", "kscale": "fp32",
               "items_ptr": "*i32", "column_ptr": "*i32", "slot_ptr": "*i32", "part_o_ptr": "*" + dtype,
               "part_ml_ptr": "*fp32"}
    bd = max(16, triton.next_power_of_2(head_dim))
    meta = {"BM": tiles.bm, "BN": tiles.bn, "BD": bd, "BDV": bd, "PREC": "ieee" if dtype == "fp32" else "tf32",
            "P_LOW": dtype != "fp32", "UPCAST": False, "EVEN_Q": True, "EVEN_K": True, "EVEN_D": True,
            "HAS_KB": key_bias, "SPLIT": split}
    signature = {name: tensors.get(name, "i32") for name in _attention_kernel.arg_names}
    signature.update({name: "constexpr" for name in meta})
    kernel = triton.compile(ASTSource(_attention_kernel, signature, meta), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    return cubin_resources(kernel)
