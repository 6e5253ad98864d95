"""FuseFlow's sparse autoencoder: relu(X · Wenc + benc) · Wdec + bdec with 90%-sparse weights.

The input is a batch of flattened grey images (ImageNet 224², NIH chest X-ray 1024²,
LUNA16 512² CT slices). FuseFlow finds partial fusion no faster than unfused here and full
fusion slower (0.63–0.67×), because the one GEMM chain has nothing cheap to fuse across; the
encoder and decoder are separate submodules so the per-layer regions are easy to name.
"""

from __future__ import annotations

import torch
from torch import nn

from .common import collect_param_formats, make_generator, small_uniform, sparse_weight

#: (input pixels, hidden width) per data set, from workloads.md.
SAE_PRESETS: dict[str, tuple[int, int]] = {
    "imagenet": (50176, 256),
    "nih-cxr": (1048576, 512),
    "luna16": (262144, 512),
}
SAE_BATCH = 32
#: Small enough for CPU tests and the Triton interpreter.
SAE_SMALL = (256, 32)


class SparseLinear(nn.Module):
    """act(X · W + b) with W (in, out) stored dense but mostly zero; act is "relu" or "none"."""

    def __init__(self, in_features: int, out_features: int, weight_density: float,
                 generator: torch.Generator, activation: str = "none",
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        if activation not in ("relu", "none"):
            raise ValueError(f"activation must be 'relu' or 'none', got {activation!r}")
        self.activation = activation
        self.weight = nn.Parameter(sparse_weight(in_features, out_features, weight_density,
                                                 generator, dtype))
        self.bias = nn.Parameter(small_uniform((out_features,), generator, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.weight
        h = h + self.bias
        if self.activation == "relu":  # a constructor constant: traces as a straight line
            h = torch.relu(h)
        return h


class SparseAutoencoder(nn.Module):
    """One-hidden-layer autoencoder: ``encoder`` (with ReLU) then ``decoder`` (linear)."""

    def __init__(self, in_features: int = SAE_SMALL[0], hidden: int = SAE_SMALL[1],
                 weight_density: float = 0.1, seed: int = 0,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        gen = make_generator(seed)
        self.encoder = SparseLinear(in_features, hidden, weight_density, gen, "relu", dtype)
        self.decoder = SparseLinear(hidden, in_features, weight_density, gen, "none", dtype)
        self.param_formats: dict[str, str] = collect_param_formats(self, ("weight",))

    @classmethod
    def preset(cls, name: str, seed: int = 0, dtype: torch.dtype = torch.float32,
               weight_density: float = 0.1) -> "SparseAutoencoder":
        """Build a workloads.md size by data-set name ("imagenet", "nih-cxr", "luna16")."""
        try:
            in_features, hidden = SAE_PRESETS[name]
        except KeyError:
            known = ", ".join(SAE_PRESETS)
            raise KeyError(f"unknown SAE preset {name!r}; known: {known}") from None
        return cls(in_features, hidden, weight_density, seed, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def sae_inputs(in_features: int, batch: int = SAE_BATCH, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A seeded batch of "images": uniform pixel intensities in [0, 1), flattened."""
    gen = make_generator(seed + 1)
    return torch.rand(batch, in_features, generator=gen).to(dtype)
