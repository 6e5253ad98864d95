"""BigBird block-sparse attention masks (global + sliding window + random blocks).

FuseFlow multiplies GPT-3's attention scores by such a mask, one of block size 16, 32 or 64
at sequence length 1024, and reports densities of about 13.4%, 26.2% and 46.1%.

Convention (chosen because it reproduces those densities; see ``expected_density``):
  * global: the first ``num_global`` block-rows and block-columns are fully set;
  * window: blocks (i, j) with |i - j| <= ``window``;
  * random: for every block-row, ``num_random`` block-columns drawn uniformly and
    independently from all block-columns (a plain seeded ``randint``), so a draw may land on
    a block that is already set. Its mean densities are 13.41% / 25.6% / 46.3%; drawing
    only among unset blocks ("exclusive") would give exactly 13.67% / 26.56% / 50.0%,
    which overshoots b64 by four points, so the published numbers used collisions.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

RANDOM_MODES = ("uniform", "exclusive")
#: FuseFlow's reported densities at sequence length 1024, per block size.
PUBLISHED_DENSITY_1024 = {16: 0.134, 32: 0.262, 64: 0.461}


@dataclass(frozen=True, eq=False)
class BlockMask:
    """A block-level boolean layout plus its block size; ``eq=False`` as it holds a tensor."""

    layout: torch.Tensor  # (nb, nb) bool: True where the block is attended
    block: int

    @property
    def num_blocks(self) -> int:
        return int(self.layout.shape[0])

    @property
    def seq_len(self) -> int:
        return self.num_blocks * self.block

    @property
    def nnz_blocks(self) -> int:
        return int(self.layout.sum())

    @property
    def density(self) -> float:
        """Fraction of the (S, S) score matrix that is attended (= fraction of blocks set)."""
        return self.nnz_blocks / self.layout.numel()

    def dense_mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (S, S) 0/1 mask the models multiply scores by."""
        b = self.block
        return self.layout.repeat_interleave(b, 0).repeat_interleave(b, 1).to(dtype)

    def to_bsr(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The mask as a torch BSR tensor: only the set blocks are stored, each all ones."""
        crow = torch.zeros(self.num_blocks + 1, dtype=torch.int64)
        crow[1:] = torch.cumsum(self.layout.sum(1), 0)
        col = self.layout.nonzero()[:, 1].contiguous()
        values = torch.ones(col.numel(), self.block, self.block, dtype=dtype)
        with warnings.catch_warnings():  # torch's "sparse BSR is in beta" notice
            warnings.filterwarnings("ignore", message=".*Sparse BSR tensor support.*")
            return torch.sparse_bsr_tensor(crow, col, values, (self.seq_len, self.seq_len),
                                           check_invariants=False)

    def causal(self) -> "BlockMask":
        """Block-lower-triangular part (the token-level triangle is the model's business)."""
        return BlockMask(torch.tril(self.layout), self.block)

    def __repr__(self) -> str:
        return (f"BlockMask(seq_len={self.seq_len}, block={self.block}, "
                f"nnz_blocks={self.nnz_blocks}, density={self.density:.4f})")


def _structural_layout(nb: int, num_global: int, window: int) -> torch.Tensor:
    """Globals and the diagonal band: the deterministic part of the mask."""
    idx = torch.arange(nb)
    layout = (idx[:, None] - idx[None, :]).abs() <= window
    layout[:num_global, :] = True
    layout[:, :num_global] = True
    return layout


def bigbird_block_mask(seq_len: int, block: int, num_global: int = 2, window: int = 1,
                       num_random: int = 2, seed: int = 0,
                       random_mode: str = "uniform") -> BlockMask:
    """A seeded BigBird block mask for a ``seq_len`` × ``seq_len`` score matrix.

    ``random_mode="uniform"`` (default) draws random block-columns from all columns, as the
    published densities imply; "exclusive" draws them only among blocks not already set.
    """
    if seq_len % block:
        raise ValueError(f"seq_len {seq_len} is not a multiple of block {block}")
    if random_mode not in RANDOM_MODES:
        raise ValueError(f"random_mode must be one of {RANDOM_MODES}, got {random_mode!r}")
    nb = seq_len // block
    layout = _structural_layout(nb, min(num_global, nb), window)
    if num_random > 0:
        gen = torch.Generator().manual_seed(int(seed))
        rows = torch.arange(nb)[:, None].expand(nb, num_random)
        if random_mode == "uniform":
            cols = torch.randint(0, nb, (nb, num_random), generator=gen)
        else:
            # Random scores, set blocks pushed below every free one: top-k picks free blocks.
            scores = torch.rand(nb, nb, generator=gen) - layout.float() * 2.0
            cols = scores.topk(min(num_random, nb), dim=1).indices
            rows = rows[:, : cols.shape[1]]
        layout[rows, cols] = True
    return BlockMask(layout, block)


def expected_density(seq_len: int, block: int, num_global: int = 2, window: int = 1,
                     num_random: int = 2) -> float:
    """Mean density over seeds of the "uniform" convention, computed exactly.

    For each block-row with ``f`` free (unset) blocks out of ``nb``, the expected number of
    free blocks hit by ``r`` independent uniform draws is ``f · (1 - (1 - 1/nb)^r)``.
    """
    nb = seq_len // block
    base = _structural_layout(nb, min(num_global, nb), window)
    free = (~base).sum(1).double()
    hit = free * (1.0 - (1.0 - 1.0 / nb) ** num_random)
    return float((base.sum() + hit.sum()) / (nb * nb))
