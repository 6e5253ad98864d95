"""Block-sparse attention as one Triton kernel: O = softmax(t(Q·Kᵀ))·V, tiles driven by a tile list.

The score transform t is affine, t(s) = a·s + b[l, m], with one a for the whole attention and
b = -inf where the mask drops the position (attention.py derives a and b from the IR at compile
time). A `TilePlan` (attention_plan.py) lists, per query tile, only the key tiles that hold a kept
position: a *uniform* tile (all kept, one b) costs what dense attention costs; a *partial* tile
loads b per position. Dropped tiles are never visited, so the work is the mask's density at tile
granularity.

Each program owns one *work item* of one batch entry: a query tile's key tiles, or a run of at
most `chunk` of them, walked with the online softmax (running max and sum, in base 2: log2(e) is
folded into a and b). A query tile split into several items (a BigBird global row visits every key
tile, the others a handful) leaves each item's own normalised output and its running max and sum in
a scratch buffer, and `_merge_kernel` combines them, as flash-decoding does; without the split such
a row is the launch's critical path. Items are launched longest first, every batch entry's before the
next item's, so that the long ones do not start last. A row that keeps no position ends as
0/0 = NaN, as eager's softmax over a row of -inf does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention_plan import LOG2E, AttentionTiles, TilePlan
from .chain_kernels import _mma, interpreting

MAX_BATCH_AXES = 3


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
                     split: bool = False, offsets: str = "fp32") -> dict:
    """Compile the kernel for sm_90 with Triton's ptxas, no GPU needed (what CI can check of the
    configs the autotuner may pick): registers, spilled bytes, shared memory per program."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .chain_wgmma import cubin_resources

    tensors = {"q_ptr": "*" + dtype, "k_ptr": "*" + dtype, "v_ptr": "*" + dtype, "o_ptr": "*" + dtype,
               "kb_ptr": "*fp32", "offsets_ptr": "*" + offsets, "shift_ptr": "*fp32", "scale": "fp32",
               "kscale": "fp32", "items_ptr": "*i32", "column_ptr": "*i32", "slot_ptr": "*i32",
               "part_o_ptr": "*" + dtype, "part_ml_ptr": "*fp32"}
    bd = max(16, triton.next_power_of_2(head_dim))
    meta = {"BM": tiles.bm, "BN": tiles.bn, "BD": bd, "BDV": bd, "PREC": "ieee" if dtype == "fp32" else "tf32",
            "P_LOW": dtype != "fp32", "UPCAST": False, "EVEN_Q": True, "EVEN_K": True, "EVEN_D": True,
            "HAS_KB": key_bias, "SPLIT": split}
    signature = {name: tensors.get(name, "i32") for name in _attention_kernel.arg_names}
    signature.update({name: "constexpr" for name in meta})
    kernel = triton.compile(ASTSource(_attention_kernel, signature, meta), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    return cubin_resources(kernel)
