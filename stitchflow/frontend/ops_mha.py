"""nn.MultiheadAttention's functional form and nn.TransformerEncoderLayer's fast path, which Dynamo keeps as one
call each in inference (F.multi_head_attention_forward: Siglip's pooling head, models built from nn's
attention; torch._transformer_encoder_layer_fwd), lowered as the ops they stand for: the input projections,
F.scaled_dot_product_attention's pattern per head (the gpu target's attention kernel) or, where the caller asks
for the weights, the scores' softmax written out, the output projection, and the encoder layer's norms and
feed-forward block."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ir.errors import UnsupportedOpError
from ..ir.expr import Cast, Const, call
from . import values as V
from .ops_attention import lower_sdpa
from .ops_elementwise import elementwise, lower_gelu, lower_relu
from .ops_linalg import contract, lower_linear
from .ops_reduce import lower_layer_norm, lower_mean, lower_softmax
from .registry import lowering, sub_ctx
from .values import TensorValue


@lowering(F.multi_head_attention_forward)
def lower_multi_head_attention(ctx, query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias,
                               bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias,
                               training=True, key_padding_mask=None, need_weights=True, attn_mask=None,
                               use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None,
                               v_proj_weight=None, static_k=None, static_v=None, average_attn_weights=True,
                               is_causal=False):
    """(output, weights or None) for sequence-first inputs (L, N, E), or unbatched (L, E)."""
    why = _refusal(query, bias_k, bias_v, add_zero_attn, dropout_p if training else 0.0, static_k, static_v)
    if why:
        raise UnsupportedOpError("multi_head_attention_forward", why, ctx.hint)
    unbatched = query.rank == 2
    if unbatched:
        query, key, value = (V.unsqueeze(t, 1) for t in (query, key, value))
        key_padding_mask = V.unsqueeze(key_padding_mask, 0) if isinstance(key_padding_mask, TensorValue) else None
    (length, batch, embed), keys = query.shape, key.shape[0]
    weights = (q_proj_weight, k_proj_weight, v_proj_weight) if use_separate_proj_weight else \
        tuple(V.slice_dim(in_proj_weight, 0, k * embed, (k + 1) * embed, 1) for k in range(3))
    biases = (None,) * 3 if in_proj_bias is None else \
        tuple(V.slice_dim(in_proj_bias, 0, k * embed, (k + 1) * embed, 1) for k in range(3))
    masks = [_mask_view(attn_mask, batch, num_heads, length, keys)] if isinstance(attn_mask, TensorValue) else []
    if isinstance(key_padding_mask, TensorValue):
        masks.append(V.reshape(key_padding_mask, [batch, 1, 1, keys]))
    out, probs = attend(ctx, (query, key, value), num_heads, weights, biases, (out_proj_weight, out_proj_bias),
                        masks, need_weights)
    if probs is not None and average_attn_weights:
        probs = lower_mean(sub_ctx(ctx, [batch, length, keys], query.dtype, "averaged"), probs, 1)
    if unbatched:
        out = V.reshape(out, [length, out.shape[-1]])
        probs = V.reshape(probs, probs.shape[1:]) if probs is not None else None
    return out, probs


def attend(ctx, inputs, num_heads, weights, biases, out_proj, masks, need_weights):
    """Multi-head attention over sequence-first (T, N, E) query, key and value: (output (L, N, E), the
    probabilities (N, H, L, S) where asked for, else None). `masks` broadcast to (N, H, L, S), nn's convention."""
    query, key, value = inputs
    (length, batch, embed), dtype = query.shape, query.dtype
    head = embed // num_heads

    def heads(x, w, b, step):  # (T, N, E) -> (N, H, T, head)
        y = lower_linear(sub_ctx(ctx, [*x.shape[:2], w.shape[0]], dtype, step), x, w, b)
        return V.permute(V.reshape(y, [x.shape[0], batch, num_heads, head]), [1, 2, 0, 3])

    q, k, v = (heads(x, w, b, s) for x, w, b, s in zip(inputs, weights, biases, ("q", "k", "v")))
    mask = _additive(ctx, masks, dtype)
    if need_weights:
        out, probs = _attention_with_weights(ctx, q, k, v, mask, dtype)
    else:
        out = lower_sdpa(sub_ctx(ctx, [*q.shape[:3], head], dtype, "attention"), q, k, v, attn_mask=mask)
        probs = None
    merged = V.reshape(V.permute(out, [2, 0, 1, 3]), [length, batch, embed])
    out_w, out_b = out_proj
    return lower_linear(sub_ctx(ctx, [length, batch, out_w.shape[0]], dtype, "out"), merged, out_w, out_b), probs


def _refusal(query, bias_k, bias_v, add_zero_attn, dropout_p, static_k, static_v) -> str | None:
    if not isinstance(query, TensorValue) or query.rank not in (2, 3):
        return "a query that is not a (L, N, E) or (L, E) tensor"
    if bias_k is not None or bias_v is not None or add_zero_attn:
        return "bias_k, bias_v or add_zero_attn (a key and value appended to every sequence)"
    if static_k is not None or static_v is not None:
        return "static keys or values"
    if dropout_p:
        return f"dropout_p={dropout_p} in training (random numbers)"
    return None


def _mask_view(mask: TensorValue, batch, heads, length, keys) -> TensorValue:
    """An attention mask of (L, S) or (N·H, L, S) seen as (1, 1, L, S) or (N, H, L, S)."""
    return V.reshape(mask, [batch, heads, length, keys] if mask.rank == 3 else [1, 1, length, keys])


def _additive(ctx, masks: list, dtype) -> TensorValue | None:
    """One additive mask of the masks' broadcast shape: nn.MultiheadAttention's boolean masks are True where a
    key is left out (-inf), as F._canonical_mask makes them; float masks add."""
    if not masks:
        return None

    def additive(m, mask):
        if mask.dtype == torch.bool:
            return call("where", m, Const(-math.inf), Const(0.0))
        return m if mask.dtype == dtype else Cast(dtype, m)

    out_shape = list(torch.broadcast_shapes(*(tuple(m.shape) for m in masks)))
    return elementwise(sub_ctx(ctx, out_shape, dtype, "mask"),
                       lambda *ms: _sum([additive(m, p) for m, p in zip(ms, masks)]), *masks)


def _sum(terms):
    total = terms[0]
    for t in terms[1:]:
        total = call("add", total, t)
    return total


def _attention_with_weights(ctx, q, k, v, mask, dtype):
    """softmax(q·kᵀ/√d + mask) and its product with v, the probabilities kept for the caller."""
    scores_shape = [*q.shape[:3], k.shape[2]]
    scores = contract(sub_ctx(ctx, scores_shape, dtype, "scores"), q, V.transpose(k, -2, -1))
    scale = 1.0 / math.sqrt(q.shape[-1])
    operands = (scores,) if mask is None else (scores, mask)
    scaled = elementwise(sub_ctx(ctx, scores_shape, dtype, "scaled"),
                         lambda s, *m: call("add", call("mul", s, Const(scale)), m[0]) if m
                         else call("mul", s, Const(scale)), *operands)
    probs = lower_softmax(sub_ctx(ctx, scores_shape, dtype, "probs"), scaled, -1)
    return contract(sub_ctx(ctx, q.shape, dtype, "context"), probs, v), probs


@lowering(torch._transformer_encoder_layer_fwd)
def lower_transformer_encoder_layer(ctx, src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                    use_gelu, norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2,
                                    ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    """nn.TransformerEncoderLayer's inference fast path (batch-first src (N, L, E)) as its ops: self-attention,
    the feed-forward block, and the two layer norms before (norm_first) or after each residual add. The mask
    comes merged (nn.MultiheadAttention.merge_masks): type 0 (L, L), 1 key padding (N, L), 2 (N, H, L, L)."""
    if not isinstance(src, TensorValue) or src.rank != 3:
        raise UnsupportedOpError("_transformer_encoder_layer_fwd", "a source that is not a (N, L, E) tensor "
                                 "(a nested tensor of padded sequences among them)", ctx.hint)
    batch, length, embed = src.shape
    dtype, shape = src.dtype, list(src.shape)
    masks = []
    if isinstance(mask, TensorValue):
        masks.append(V.reshape(mask, [batch, 1, 1, length]) if mask_type == 1
                     else _mask_view(mask, batch, num_heads, length, length) if mask.rank < 4 else mask)
    weights = tuple(V.slice_dim(qkv_weight, 0, k * embed, (k + 1) * embed, 1) for k in range(3))
    biases = tuple(V.slice_dim(qkv_bias, 0, k * embed, (k + 1) * embed, 1) for k in range(3))

    def norm(x, w, b, step):
        return lower_layer_norm(sub_ctx(ctx, shape, dtype, step), x, [embed], w, b, eps)

    def self_attention(x):
        seq = V.permute(x, [1, 0, 2])
        out, _ = attend(ctx, (seq, seq, seq), num_heads, weights, biases, (proj_weight, proj_bias), masks, False)
        return V.permute(out, [1, 0, 2])

    def feed_forward(x):
        hidden = lower_linear(sub_ctx(ctx, [batch, length, ffn_weight_1.shape[0]], dtype, "ffn1"), x, ffn_weight_1,
                              ffn_bias_1)
        act = sub_ctx(ctx, hidden.shape, dtype, "act")
        hidden = lower_gelu(act, hidden) if use_gelu else lower_relu(act, hidden)
        return lower_linear(sub_ctx(ctx, shape, dtype, "ffn2"), hidden, ffn_weight_2, ffn_bias_2)

    def residual(x, y, step):
        return elementwise(sub_ctx(ctx, shape, dtype, step), lambda a, b: call("add", a, b), x, y)

    if norm_first:
        x = residual(src, self_attention(norm(src, norm_weight_1, norm_bias_1, "norm1")), "res1")
        return residual(x, feed_forward(norm(x, norm_weight_2, norm_bias_2, "norm2")), "res2")
    x = norm(residual(src, self_attention(src), "res1"), norm_weight_1, norm_bias_1, "norm1")
    return norm(residual(x, feed_forward(x), "res2"), norm_weight_2, norm_bias_2, "norm2")
