"""GPT-3-small decoders with BigBird block-sparse attention, FuseFlow's headline workload.

Pre-LN decoder: ``h = x + attn(ln1(x)); y = h + ffn(ln2(h))`` with a GELU FFN. The attention
scores are multiplied by the 0/1 block mask, scaled by 1/sqrt(head_dim) (= 1/8 at 64), and the
masked positions set to -inf before the softmax so that they carry no probability.

The submodules follow FuseFlow's partial-fusion regions, so per-submodule fusion *is* the
"partially fused" configuration:
  * ``qkv``  — LayerNorm 1 + the fused Q/K/V projection;
  * ``attn`` — head split, scores, mask, scale, softmax, ·V, head merge (the attention core);
  * ``mlp``  — out-projection + residual + LayerNorm 2 + FFN + residual.
Fully fused GPT-3 additionally takes the next decoder's ``qkv`` into the ``mlp`` region;
that crosses submodules and is the planner's job.

Inputs are (S, width) for batch 1, or (..., S, width) with any leading batch dims.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .bigbird import BlockMask, bigbird_block_mask
from .common import init_norm, make_generator, merge_heads, seeded_linear, split_heads

GPT3_PRESETS: dict[str, dict[str, int]] = {
    "small": dict(num_layers=2, width=64, heads=4, ffn=256, seq=128, block=16),
    "gpt3-small": dict(num_layers=12, width=768, heads=12, ffn=3072, seq=1024, block=16),
}


class QKVProjection(nn.Module):
    """LayerNorm then one (width → 3·width) projection: FuseFlow's "LN+QKV" region."""

    def __init__(self, width: int, gen: torch.Generator, dtype: torch.dtype, eps: float = 1e-5):
        super().__init__()
        self.ln = init_norm(nn.LayerNorm(width, eps=eps, dtype=dtype), gen)
        self.proj = seeded_linear(width, 3 * width, gen, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln(x))


class BlockSparseAttention(nn.Module):
    """The attention core on a packed (..., S, 3·width) QKV tensor, masked by a BigBird mask."""

    def __init__(self, width: int, heads: int, mask: torch.Tensor):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by {heads} heads")
        self.width, self.heads = width, heads
        self.scale = 1.0 / math.sqrt(width // heads)
        self.register_buffer("mask", mask)

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        w = self.width
        q = split_heads(qkv[..., :w], self.heads)
        k = split_heads(qkv[..., w: 2 * w], self.heads)
        v = split_heads(qkv[..., 2 * w:], self.heads)
        scores = q @ k.transpose(-1, -2)
        scores = scores * self.mask
        scores = scores * self.scale
        scores = scores.masked_fill(self.mask == 0, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return merge_heads(probs @ v)


class OutputAndFFN(nn.Module):
    """out-proj + residual + LayerNorm 2 + GELU FFN + residual: FuseFlow's third region."""

    def __init__(self, width: int, ffn: int, gen: torch.Generator, dtype: torch.dtype,
                 eps: float = 1e-5):
        super().__init__()
        self.out_proj = seeded_linear(width, width, gen, dtype=dtype)
        self.ln = init_norm(nn.LayerNorm(width, eps=eps, dtype=dtype), gen)
        self.fc1 = seeded_linear(width, ffn, gen, dtype=dtype)
        self.fc2 = seeded_linear(ffn, width, gen, dtype=dtype)

    def forward(self, attn: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = x + self.out_proj(attn)
        return h + self.fc2(F.gelu(self.fc1(self.ln(h))))


def _mask_tensor(mask: BlockMask, seq: int, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    if mask.seq_len != seq:
        raise ValueError(f"block mask covers {mask.seq_len} tokens, model expects {seq}")
    dense = mask.dense_mask(dtype)
    return torch.tril(dense) if causal else dense


class GPT3Decoder(nn.Module):
    """One GPT-3 decoder block (GPT-3-small sizes by default) with BigBird attention.

    ``mask`` overrides the default ``bigbird_block_mask(seq, block, seed=seed)``; ``causal``
    additionally keeps only the lower triangle (FuseFlow's mask is not causal).
    ``generator`` lets a stack draw all its weights from one stream.
    """

    def __init__(self, width: int = 768, heads: int = 12, ffn: int = 3072, seq: int = 1024,
                 block: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32,
                 mask: BlockMask | None = None, causal: bool = False,
                 generator: torch.Generator | None = None):
        super().__init__()
        gen = generator if generator is not None else make_generator(seed)
        self.block_mask = mask if mask is not None else bigbird_block_mask(seq, block, seed=seed)
        self.qkv = QKVProjection(width, gen, dtype)
        self.attn = BlockSparseAttention(width, heads,
                                         _mask_tensor(self.block_mask, seq, causal, dtype))
        self.mlp = OutputAndFFN(width, ffn, gen, dtype)
        self.param_formats = {n: "dense" for n, _ in self.named_parameters()}
        self.buffer_formats = {"attn.mask": f"bsr{self.block_mask.block}"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(self.qkv(x)), x)


class GPT3(nn.Module):
    """A stack of ``num_layers`` decoders sharing one block mask, in ``self.decoders``.

    ``partial_depth = 2``: per-layer ("partial") fusion splits each decoder into FuseFlow's
    three regions (LN+QKV / attention / out-proj+residual+LN+FFN+residual)."""

    partial_depth = 2

    def __init__(self, num_layers: int = 12, width: int = 768, heads: int = 12, ffn: int = 3072,
                 seq: int = 1024, block: int = 16, seed: int = 0,
                 dtype: torch.dtype = torch.float32, mask: BlockMask | None = None,
                 causal: bool = False):
        super().__init__()
        gen = make_generator(seed)
        self.block_mask = mask if mask is not None else bigbird_block_mask(seq, block, seed=seed)
        self.decoders = nn.ModuleList(
            GPT3Decoder(width, heads, ffn, seq, block, seed, dtype, self.block_mask, causal, gen)
            for _ in range(num_layers))
        self.param_formats = {n: "dense" for n, _ in self.named_parameters()}
        self.buffer_formats = {f"decoders.{i}.attn.mask": f"bsr{self.block_mask.block}" for i in range(num_layers)}

    @classmethod
    def preset(cls, name: str, seed: int = 0, dtype: torch.dtype = torch.float32,
               **overrides) -> "GPT3":
        """Build "small" (CPU tests) or "gpt3-small" (FuseFlow's size); kwargs override."""
        try:
            cfg = dict(GPT3_PRESETS[name])
        except KeyError:
            known = ", ".join(GPT3_PRESETS)
            raise KeyError(f"unknown GPT-3 preset {name!r}; known: {known}") from None
        cfg.update(overrides)
        return cls(seed=seed, dtype=dtype, **cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for decoder in self.decoders:
            x = decoder(x)
        return x
