"""Dense transformer blocks for the memory-intensive and compute-chain fusion workloads.

* ``BertBlock`` — post-LN encoder: ``h = ln1(x + attn(x)); y = ln2(h + ffn(h))``. It carries
  FusionStitching's favourite patterns: bias + residual + LayerNorm, scale + mask + softmax,
  bias + GELU.
* ``LlamaBlock`` — pre-norm decoder: RMSNorm, rotary embeddings, grouped-query causal
  attention and a SwiGLU FFN ``down(silu(gate(x)) * up(x))``, FlashFuser's gated-FFN chain.

Both take (..., S, width) inputs and contain no data-dependent Python control flow; every
``if`` tests a constructor constant, so ``torch.fx.symbolic_trace`` records one straight line.
Rotary tables and the causal mask are buffers sized for ``seq``, so inputs must have
exactly ``seq`` tokens (static shapes keep the traced graph free of size arithmetic).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .common import (init_norm, make_generator, merge_heads, seeded_linear, small_uniform,
                     split_heads)

BERT_PRESETS: dict[str, dict[str, int]] = {
    "small": dict(width=64, heads=4, ffn=256, seq=32),
    "bert-base": dict(width=768, heads=12, ffn=3072, seq=512),
    "bert-large": dict(width=1024, heads=16, ffn=4096, seq=512),
}
LLAMA_PRESETS: dict[str, dict[str, int]] = {
    "small": dict(width=64, heads=4, kv_heads=2, ffn=172, seq=32),
    "llama2-7b": dict(width=4096, heads=32, kv_heads=32, ffn=11008, seq=2048),
    "llama3-8b": dict(width=4096, heads=32, kv_heads=8, ffn=14336, seq=2048),
}


# ----------------------------------------------------------------------------- BERT


class BertSelfAttention(nn.Module):
    """Dense softmax attention with separate Q/K/V projections, as BERT checkpoints store them."""

    def __init__(self, width: int, heads: int, dropout: float, use_mask: bool,
                 gen: torch.Generator, dtype: torch.dtype):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by {heads} heads")
        self.heads, self.use_mask = heads, use_mask
        self.scale = 1.0 / math.sqrt(width // heads)
        self.query = seeded_linear(width, width, gen, dtype=dtype)
        self.key = seeded_linear(width, width, gen, dtype=dtype)
        self.value = seeded_linear(width, width, gen, dtype=dtype)
        self.dropout = nn.Dropout(dropout)
        self.output = seeded_linear(width, width, gen, dtype=dtype)
        self.output_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        q = split_heads(self.query(x), self.heads)
        k = split_heads(self.key(x), self.heads)
        v = split_heads(self.value(x), self.heads)
        scores = (q @ k.transpose(-1, -2)) * self.scale
        if self.use_mask:  # a constructor flag: a Proxy is never None, so test the flag
            scores = scores + attn_mask
        probs = self.dropout(torch.softmax(scores, dim=-1))
        return self.output_dropout(self.output(merge_heads(probs @ v)))


class BertFFN(nn.Module):
    """Linear → GELU → Linear → dropout (BERT's "intermediate" and "output" dense layers)."""

    def __init__(self, width: int, ffn: int, dropout: float, gen: torch.Generator,
                 dtype: torch.dtype):
        super().__init__()
        self.intermediate = seeded_linear(width, ffn, gen, dtype=dtype)
        self.output = seeded_linear(ffn, width, gen, dtype=dtype)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.output(F.gelu(self.intermediate(x))))


class BertBlock(nn.Module):
    """One BERT encoder layer. With ``use_mask`` the forward adds ``attn_mask`` (additive,
    broadcastable to (..., H, S, S), e.g. 0 / -inf padding masks) to the scaled scores."""

    def __init__(self, width: int = 64, heads: int = 4, ffn: int = 256, seq: int = 32,
                 dropout: float = 0.1, eps: float = 1e-12, use_mask: bool = False,
                 seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        gen = make_generator(seed)
        self.seq, self.width = seq, width
        self.attn = BertSelfAttention(width, heads, dropout, use_mask, gen, dtype)
        self.ln1 = init_norm(nn.LayerNorm(width, eps=eps, dtype=dtype), gen)
        self.ffn = BertFFN(width, ffn, dropout, gen, dtype)
        self.ln2 = init_norm(nn.LayerNorm(width, eps=eps, dtype=dtype), gen)
        self.param_formats = {n: "dense" for n, _ in self.named_parameters()}

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.ln1(x + self.attn(x, attn_mask))
        return self.ln2(h + self.ffn(h))


# ----------------------------------------------------------------------------- Llama


class RMSNorm(nn.Module):
    """x · rsqrt(mean(x²) + eps) · weight, written out (default) or via ``F.rms_norm``."""

    def __init__(self, width: int, eps: float = 1e-6, functional: bool = False,
                 gen: torch.Generator | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.width, self.eps, self.functional = width, eps, functional
        weight = torch.ones(width, dtype=dtype)
        if gen is not None:
            weight = weight + small_uniform((width,), gen, dtype=dtype)
        self.weight = nn.Parameter(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.functional:
            return F.rms_norm(x, (self.width,), self.weight, self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor, half: int | None = None) -> torch.Tensor:
    """(x1, x2) → (-x2, x1) on the two halves of the last dim (the HF/Llama rotary layout).

    Pass ``half`` when it is known: a constant slice bound keeps size arithmetic
    (``x.shape[-1] // 2``) out of traced graphs.
    """
    half = x.shape[-1] // 2 if half is None else half
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables, (seq, head_dim) each, applied as q·cos + rotate_half(q)·sin."""

    def __init__(self, head_dim: int, seq: int, base: float = 10000.0,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.half = head_dim // 2
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.cos + rotate_half(x, self.half) * self.sin


class LlamaAttention(nn.Module):
    """Causal grouped-query attention with optional rotary embeddings and no biases."""

    def __init__(self, width: int, heads: int, kv_heads: int, seq: int, rope: bool,
                 causal: bool, rope_base: float, gen: torch.Generator, dtype: torch.dtype):
        super().__init__()
        if width % heads or heads % kv_heads:
            raise ValueError("width must divide by heads and heads by kv_heads")
        head_dim = width // heads
        self.heads, self.kv_heads, self.groups = heads, kv_heads, heads // kv_heads
        self.rope, self.causal = rope, causal
        self.scale = 1.0 / math.sqrt(head_dim)
        self.q_proj = seeded_linear(width, width, gen, bias=False, dtype=dtype)
        self.k_proj = seeded_linear(width, kv_heads * head_dim, gen, bias=False, dtype=dtype)
        self.v_proj = seeded_linear(width, kv_heads * head_dim, gen, bias=False, dtype=dtype)
        self.o_proj = seeded_linear(width, width, gen, bias=False, dtype=dtype)
        self.rotary = RotaryEmbedding(head_dim, seq, rope_base, dtype) if rope else None
        upper = torch.triu(torch.full((seq, seq), float("-inf"), dtype=dtype), diagonal=1)
        self.register_buffer("causal_mask", upper, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = split_heads(self.q_proj(x), self.heads)
        k = split_heads(self.k_proj(x), self.kv_heads)
        v = split_heads(self.v_proj(x), self.kv_heads)
        if self.rope:
            q, k = self.rotary(q), self.rotary(k)
        if self.groups > 1:
            # Grouped query heads broadcast against their shared K/V head, (.., KV, G, S, D),
            # instead of copying K/V with repeat_interleave: head h reads KV head h // G.
            q = q.unflatten(-3, (self.kv_heads, self.groups))
            k, v = k.unsqueeze(-3), v.unsqueeze(-3)
        scores = (q @ k.transpose(-1, -2)) * self.scale
        if self.causal:
            scores = scores + self.causal_mask
        out = torch.softmax(scores, dim=-1) @ v
        if self.groups > 1:
            out = out.flatten(-4, -3)
        return self.o_proj(merge_heads(out))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the gated FFN of Llama, a GEMM → act → GEMM chain."""

    def __init__(self, width: int, ffn: int, gen: torch.Generator, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = seeded_linear(width, ffn, gen, bias=False, dtype=dtype)
        self.up_proj = seeded_linear(width, ffn, gen, bias=False, dtype=dtype)
        self.down_proj = seeded_linear(ffn, width, gen, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm decoder: ``h = x + attn(norm1(x)); y = h + mlp(norm2(h))``."""

    def __init__(self, width: int = 64, heads: int = 4, kv_heads: int | None = None,
                 ffn: int = 172, seq: int = 32, rope: bool = True, causal: bool = True,
                 eps: float = 1e-6, functional_rms_norm: bool = False,
                 rope_base: float = 10000.0, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        gen = make_generator(seed)
        self.seq, self.width = seq, width
        self.norm1 = RMSNorm(width, eps, functional_rms_norm, gen, dtype)
        self.attn = LlamaAttention(width, heads, kv_heads or heads, seq, rope, causal,
                                   rope_base, gen, dtype)
        self.norm2 = RMSNorm(width, eps, functional_rms_norm, gen, dtype)
        self.mlp = SwiGLU(width, ffn, gen, dtype)
        self.param_formats = {n: "dense" for n, _ in self.named_parameters()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm1(x))
        return h + self.mlp(self.norm2(h))


def _preset(table: dict[str, dict[str, int]], name: str, kind: str) -> dict[str, int]:
    try:
        return dict(table[name])
    except KeyError:
        raise KeyError(f"unknown {kind} preset {name!r}; known: {', '.join(table)}") from None


def bert_preset(name: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                **overrides) -> BertBlock:
    """A ``BertBlock`` of a named size ("small", "bert-base", "bert-large")."""
    return BertBlock(seed=seed, dtype=dtype, **{**_preset(BERT_PRESETS, name, "BERT"), **overrides})


def llama_preset(name: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                 **overrides) -> LlamaBlock:
    """A ``LlamaBlock`` of a named size ("small", "llama2-7b", "llama3-8b")."""
    cfg = {**_preset(LLAMA_PRESETS, name, "Llama"), **overrides}
    if name == "llama3-8b":
        cfg.setdefault("rope_base", 500000.0)
    return LlamaBlock(seed=seed, dtype=dtype, **cfg)
