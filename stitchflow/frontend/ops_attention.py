"""F.scaled_dot_product_attention as the IR's attention: S = Q·Kᵀ, the scale and masks as an elementwise
transform of S, a softmax over the keys, O = P·V. Written this way, it is the pattern the gpu target
recognises and runs as one flash-style kernel (targets/gpu/attention.py), and every other target runs
it node by node."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ir.errors import ShapeError, UnsupportedOpError
from ..ir.expr import Const, IndexValue, call
from . import ops_random, values as V
from .ops_elementwise import elementwise
from .ops_linalg import contract
from .ops_reduce import lower_softmax, reduce
from .registry import lowering, own_op, sub_ctx, upcast
from .values import TensorValue


def _grouped_heads(kv: TensorValue, heads: int) -> TensorValue:
    """K or V of H_kv heads seen as `heads` heads, each group of heads // H_kv sharing one (enable_gqa)."""
    kv_heads = kv.shape[-3]
    if heads % kv_heads:
        raise ShapeError(f"scaled_dot_product_attention: {heads} query heads do not group over {kv_heads} key heads")
    shape = list(kv.shape)
    shape[-3] = heads
    rank = len(shape)
    ranges = {f"_{d}": n for d, n in enumerate(shape)}
    old = [V.placeholder(d) for d in range(rank)]
    old[rank - 3] = V.floordiv(V.placeholder(rank - 3), heads // kv_heads, ranges)
    return kv.remap(shape, old)


@lowering(F.scaled_dot_product_attention, "aten.scaled_dot_product_attention")
def lower_sdpa(ctx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if not all(isinstance(t, TensorValue) for t in (q, k, v)):
        raise UnsupportedOpError("scaled_dot_product_attention", "query, key and value must be tensors", ctx.hint)
    if enable_gqa and q.rank >= 3 and k.shape[-3] != q.shape[-3]:
        k, v = _grouped_heads(k, q.shape[-3]), _grouped_heads(v, q.shape[-3])
    length, keys = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    batch = list(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
    score_shape = batch + [length, keys]
    scores = contract(sub_ctx(ctx, score_shape, q.dtype, "scores"), q, V.transpose(k, -2, -1))
    mask = attn_mask if isinstance(attn_mask, TensorValue) else None

    def body(o, r, rg):
        s = upcast(scores.read(o, rg), scores)
        m = mask.read_broadcast(o, score_shape, rg) if mask is not None else None
        return _masked(call("mul", s, Const(float(scale))), m, mask, is_causal, o)

    shaped = sub_ctx(ctx, score_shape, q.dtype, "masked")
    masked = shaped.builder.emit(score_shape, q.dtype, body, hint=shaped.hint)
    probs = lower_softmax(sub_ctx(ctx, score_shape, q.dtype, "probs"), masked, -1)
    if dropout_p:  # (applied in eval mode too, as torch's)
        probs = ops_random.dropout(sub_ctx(ctx, score_shape, q.dtype, "dropout"), probs, dropout_p, ctx)
    out = contract(ctx, probs, v)
    if mask is None:
        return out
    return _zero_fully_masked_rows(ctx, out, mask)


def _masked(s, m, mask: TensorValue | None, causal: bool, o=None):
    """The scores with a boolean mask's dropped positions at -inf, a float mask added, and causal
    positions (key after query, top-left aligned as torch's tril) at -inf."""
    if m is not None:
        s = call("where", m, s, Const(-math.inf)) if mask.dtype == torch.bool else call("add", s, upcast(m, mask))
    if causal:
        s = call("where", call("le", IndexValue(o[-1]), IndexValue(o[-2])), s, Const(-math.inf))
    return s


def _zero_fully_masked_rows(ctx, out: TensorValue, mask: TensorValue) -> TensorValue:
    """torch's attention gives zeros for a query whose every key is masked (a softmax over nothing
    would be NaN): keep[.., l] = any key kept, from the mask alone and in its own shape (a mask shared
    by every head is reduced once), so that the attention itself stays the pattern the gpu target fuses."""
    def kept_key(e, o):
        kept = e if mask.dtype == torch.bool else call("ne", e, Const(-math.inf))
        return call("where", kept, Const(1.0), Const(0.0))

    with own_op(ctx, "kept"):  # ops of their own: the planner weighs fusing them (kept per head) by its costs
        kept = reduce(sub_ctx(ctx, mask.shape[:-1], torch.float32, "kept"), mask, [-1], "max", dtype=torch.float32,
                      pre=kept_key)
    with own_op(ctx, "rows"):
        return elementwise(sub_ctx(ctx, out.shape, out.dtype, "rows"),
                           lambda x, keep: call("where", call("gt", keep, Const(0.0)), x, Const(0.0)),
                           out, V.unsqueeze(kept, -1))
