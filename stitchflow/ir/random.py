"""Counter-based random numbers: the IR's `rand(seed, offset)` and `randn(seed, offset)`.

A value is a pure function of a seed and an element's offset (Philox-4x32 with 10 rounds, the generator of
Triton's `tl.rand` and `tl.randn`, which the gpu target emits), so every target computes the same numbers for
the same seed, a node recomputed in another kernel draws them again exactly, and no state is carried between
elements. A program draws a fresh seed from torch's generator at every call (program.Program.random_seed), so a
seeded run is reproducible, though its numbers are not eager's (torch's generators are another algorithm).

Here the Philox rounds run in numpy's uint64 arithmetic: the 32-bit products fit exactly."""

from __future__ import annotations

import numpy as np
import torch

ROUNDS = 10
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85  # the key's increments per round
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57  # the multipliers
MASK = 0xFFFFFFFF
UNIT = np.float32(4.6566127342e-10)  # the largest scale with (2^31 - 1) * UNIT < 1 in float32


def _philox(seed: np.ndarray, offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first two 32-bit words of Philox-4x32-10 for counter (offset low, offset high, 0, 0), key = seed."""
    seed, offset = np.broadcast_arrays(seed.astype(np.uint64), offset.astype(np.int64).astype(np.uint64))
    c0, c1 = offset & MASK, offset >> np.uint64(32)
    c2 = c3 = np.zeros_like(c0)
    k0, k1 = seed & MASK, (seed >> np.uint64(32)) & MASK
    for _ in range(ROUNDS):
        p0, p2 = np.uint64(ROUND_A) * c0, np.uint64(ROUND_B) * c2  # exact: both factors below 2^32
        c0, c1, c2, c3 = (p2 >> np.uint64(32)) ^ c1 ^ k0, p2 & MASK, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & MASK
        k0, k1 = (k0 + KEY_A) & MASK, (k1 + KEY_B) & MASK
    return c0, c1


def _uniform(word: np.ndarray) -> np.ndarray:
    """A 32-bit word as a float32 in [0, 1): read as a signed int, folded onto the non-negative ones, scaled."""
    signed = word.astype(np.int64)
    signed = np.where(signed >= 1 << 31, signed - (1 << 32), signed)
    folded = np.where(signed < 0, -signed - 1, signed)
    return folded.astype(np.float32) * UNIT


def _arrays(seed, offset) -> tuple[np.ndarray, np.ndarray]:
    as_array = (lambda v: v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v))
    return as_array(seed), as_array(offset)


def _tensor(values: np.ndarray, *like) -> torch.Tensor:
    """float32 values as a tensor on the device of the first tensor among `like` (the CPU if none)."""
    device = next((v.device for v in like if isinstance(v, torch.Tensor)), torch.device("cpu"))
    return torch.from_numpy(np.ascontiguousarray(values.astype(np.float32))).to(device)


def uniform(seed, offset) -> torch.Tensor:
    """U[0, 1) float32 numbers, one per offset (tl.rand)."""
    c0, _ = _philox(*_arrays(seed, offset))
    return _tensor(_uniform(c0), offset, seed)


def normal(seed, offset) -> torch.Tensor:
    """N(0, 1) float32 numbers, one per offset (tl.randn: Box-Muller on the first two words)."""
    c0, c1 = _philox(*_arrays(seed, offset))
    u1, u2 = np.maximum(np.float32(1e-7), _uniform(c0)), _uniform(c1)
    radius = np.sqrt(np.float32(-2.0) * np.log(u1))
    return _tensor(radius * np.cos(np.float32(6.283185307179586) * u2), offset, seed)
