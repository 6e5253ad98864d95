"""BigBird block masks: published densities, the structure of each part, formats."""

from __future__ import annotations

import pytest
import torch

from stitchflow.apps import bigbird_block_mask, expected_density
from stitchflow.apps.bigbird import PUBLISHED_DENSITY_1024


@pytest.mark.parametrize("block", [16, 32, 64])
def test_density_near_published(block):
    published = PUBLISHED_DENSITY_1024[block]
    # The convention's mean density matches FuseFlow's numbers to within 0.7 points ...
    assert abs(expected_density(1024, block) - published) < 0.007
    # ... and the seed-0 mask is within the seed-to-seed spread (b64: std ≈ 1 point).
    assert abs(bigbird_block_mask(1024, block).density - published) < 0.015


@pytest.mark.parametrize("block", [16, 64])
def test_expected_density_formula(block):
    mean = sum(bigbird_block_mask(1024, block, seed=s).density for s in range(100)) / 100
    assert abs(mean - expected_density(1024, block)) < 0.004


def test_structure_globals_window_randoms():
    mask = bigbird_block_mask(1024, 32, seed=5)
    layout, nb = mask.layout, 32
    assert layout.dtype == torch.bool and layout.shape == (nb, nb)
    assert mask.num_blocks == nb and mask.seq_len == 1024 and mask.block == 32
    assert layout[:2].all() and layout[:, :2].all()
    idx = torch.arange(nb)
    band = (idx[:, None] - idx[None, :]).abs() <= 1
    assert layout[band].all()
    extra = layout & ~band
    extra[:2], extra[:, :2] = False, False
    assert (extra.sum(1) <= 2).all() and extra.sum() > nb  # randoms in most rows
    # Random part is seeded: same seed same mask, another seed another mask.
    assert torch.equal(layout, bigbird_block_mask(1024, 32, seed=5).layout)
    assert not torch.equal(layout, bigbird_block_mask(1024, 32, seed=6).layout)


def test_parameters_and_exclusive_mode():
    no_random = bigbird_block_mask(1024, 64, num_random=0)
    assert no_random.nnz_blocks == 100  # 2 globals (60 blocks) + band outside them (40)
    exclusive = [bigbird_block_mask(1024, b, random_mode="exclusive").nnz_blocks
                 for b in (16, 32, 64)]
    assert exclusive == [560, 272, 128]  # every random draw lands on a new block
    wide = bigbird_block_mask(256, 16, num_global=0, window=2, num_random=0)
    assert wide.nnz_blocks == 16 * 5 - 2 * (1 + 2)
    with pytest.raises(ValueError):
        bigbird_block_mask(1000, 16)
    with pytest.raises(ValueError):
        bigbird_block_mask(1024, 16, random_mode="nope")


def test_dense_and_bsr_forms():
    mask = bigbird_block_mask(256, 16, seed=1)
    dense = mask.dense_mask()
    assert dense.shape == (256, 256) and dense.dtype == torch.float32
    assert set(torch.unique(dense).tolist()) == {0.0, 1.0}
    assert abs(dense.mean().item() - mask.density) < 1e-9
    blocks = dense.unflatten(0, (16, 16)).unflatten(2, (16, 16)).amax((1, 3))
    assert torch.equal(blocks.bool(), mask.layout)
    bsr = mask.to_bsr(torch.float64)
    assert bsr.layout == torch.sparse_bsr and bsr.values().shape == (mask.nnz_blocks, 16, 16)
    assert torch.equal(bsr.to_dense(), mask.dense_mask(torch.float64))
    causal = mask.causal()
    assert torch.equal(causal.layout, torch.tril(mask.layout))
    assert "density" in repr(mask)
