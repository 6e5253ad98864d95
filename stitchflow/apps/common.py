"""Shared helpers for the app zoo: seeded initialisation and format annotations.

Every model in the zoo draws its weights from one ``torch.Generator`` seeded by the
constructor's ``seed`` argument, so that two builds with the same seed are bit-identical
(the compiler's tests compare compiled code against eager on the same weights) and no
model touches torch's global RNG (tests run in any order, in parallel).
"""

from __future__ import annotations

import math

import torch
from torch import nn

#: Above this many entries a weight's sparsity mask is drawn per entry (Bernoulli) rather
#: than as an exact random subset: ``randperm`` over 10^8+ entries would cost gigabytes of
#: int64 indices for the NIH-CXR autoencoder, while the Bernoulli count is exact to 1e-4 there.
EXACT_MASK_LIMIT = 1 << 24


def make_generator(seed: int) -> torch.Generator:
    """A private CPU generator, so model builds never disturb (or depend on) global RNG state."""
    return torch.Generator().manual_seed(int(seed))


def sparse_weight(rows: int, cols: int, density: float, gen: torch.Generator,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A Glorot-uniform (rows, cols) matrix with a seeded random ``1 - density`` of it zeroed.

    FuseFlow's GNN and autoencoder weights are unstructured-sparse but stored here as dense
    tensors with explicit zeros; the frontend reads ``param_formats`` to know to compress
    them. Scaling by ``1/sqrt(density)`` keeps activations of order one whatever the density,
    so softmax outputs stay informative in numerical comparisons.
    """
    if not 0.0 < density <= 1.0:
        raise ValueError(f"weight density must be in (0, 1], got {density}")
    bound = math.sqrt(6.0 / (rows + cols)) / math.sqrt(density)
    # In place throughout: the NIH-CXR decoder alone is 537M entries (2 GiB in float32).
    w = torch.rand(rows, cols, generator=gen).mul_(2.0).sub_(1.0).mul_(bound)
    if density < 1.0:
        w.view(-1).masked_fill_(~_keep_mask(rows * cols, density, gen), 0.0)
    return w.to(dtype)


def _keep_mask(numel: int, density: float, gen: torch.Generator) -> torch.Tensor:
    """Exactly ``round(density * numel)`` kept entries when small, Bernoulli when huge."""
    if numel <= EXACT_MASK_LIMIT:
        keep = torch.zeros(numel, dtype=torch.bool)
        keep[torch.randperm(numel, generator=gen)[: round(density * numel)]] = True
        return keep
    return torch.rand(numel, generator=gen) < density


def small_uniform(shape: tuple[int, ...], gen: torch.Generator, scale: float = 0.1,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Non-zero biases and norm offsets: zeros would hide indexing bugs in compiled code."""
    return ((torch.rand(shape, generator=gen) * 2.0 - 1.0) * scale).to(dtype)


def init_linear(linear: nn.Linear, gen: torch.Generator) -> nn.Linear:
    """Re-initialise an ``nn.Linear`` from ``gen`` (its own init uses the global RNG)."""
    with torch.no_grad():
        bound = 1.0 / math.sqrt(linear.in_features)
        linear.weight.copy_((torch.rand(linear.weight.shape, generator=gen) * 2 - 1) * bound)
        if linear.bias is not None:
            linear.bias.copy_((torch.rand(linear.bias.shape, generator=gen) * 2 - 1) * bound)
    return linear


def init_norm(norm: nn.Module, gen: torch.Generator) -> nn.Module:
    """Give a norm's affine parameters values near (1, 0) but not exactly, for testing."""
    with torch.no_grad():
        if getattr(norm, "weight", None) is not None:
            norm.weight.copy_(1.0 + small_uniform(tuple(norm.weight.shape), gen))
        if getattr(norm, "bias", None) is not None:
            norm.bias.copy_(small_uniform(tuple(norm.bias.shape), gen))
    return norm


def collect_param_formats(module: nn.Module,
                          sparse_suffixes: tuple[str, ...] = ()) -> dict[str, str]:
    """Map every parameter name to "dcsr" (name ends with a sparse suffix) or "dense".

    The names are those of ``named_parameters()`` — the same strings torch.fx uses as
    ``get_attr`` targets — so the frontend can annotate traced graphs without guessing.
    """
    return {name: ("dcsr" if name.split(".")[-1] in sparse_suffixes else "dense")
            for name, _ in module.named_parameters()}


def seeded_linear(in_features: int, out_features: int, gen: torch.Generator, bias: bool = True,
                  dtype: torch.dtype = torch.float32) -> nn.Linear:
    """An ``nn.Linear`` initialised from ``gen`` only (``skip_init`` avoids the global RNG)."""
    linear = torch.nn.utils.skip_init(nn.Linear, in_features, out_features, bias=bias,
                                      dtype=dtype)
    return init_linear(linear, gen)


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(..., S, H·D) → (..., H, S, D) with constant sizes only, so torch.fx can trace it."""
    return x.unflatten(-1, (heads, -1)).transpose(-3, -2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(..., H, S, D) → (..., S, H·D), the inverse of ``split_heads``."""
    return x.transpose(-3, -2).flatten(-2)
