"""Graph loaders: the real Cora split, the synthetic stand-ins and the adjacency layouts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from stitchflow.apps import DATASETS, load_dataset, load_planetoid, synthetic_powerlaw
from stitchflow.apps.graphs import DATA_DIR, PLANETOID_PARTS

SHARED_PLANETOID = Path("/work/shared/data/planetoid")


@pytest.fixture(scope="module")
def cora():
    return load_planetoid("cora")


def assert_canonical(edge_index: torch.Tensor, num_nodes: int) -> None:
    """Symmetric, no self loops, unique, sorted row-major: what every loader promises."""
    assert edge_index.dtype == torch.int64 and edge_index.shape[0] == 2
    row, col = edge_index
    assert (row != col).all()
    keys = row * num_nodes + col
    assert (keys[1:] > keys[:-1]).all()  # strictly increasing = sorted and unique
    assert torch.equal(torch.sort(col * num_nodes + row).values, keys)
    assert int(edge_index.max()) < num_nodes


def test_cora_counts(cora):
    assert cora.name == "cora" and not cora.synthetic
    assert cora.num_nodes == 2708
    assert cora.x.shape == (2708, 1433) and cora.x.dtype == torch.float32
    assert cora.num_edges() == 10556 and cora.num_undirected_edges() == 5278
    assert cora.y.shape == (2708,) and cora.y.dtype == torch.int64
    assert set(cora.y.tolist()) == set(range(7))
    assert_canonical(cora.edge_index, cora.num_nodes)
    assert set(torch.unique(cora.x).tolist()) == {0.0, 1.0}  # bag-of-words features


def test_cora_matches_torch_geometric_reader(cora):
    planetoid = pytest.importorskip("torch_geometric.io.planetoid")
    from torch_geometric.utils import coalesce

    ref = planetoid.read_planetoid_data(str(DATA_DIR), "cora")
    assert torch.equal(ref.x, cora.x)
    assert torch.equal(ref.y, cora.y)
    assert torch.equal(coalesce(ref.edge_index, num_nodes=2708), cora.edge_index)


@pytest.mark.skipif(not SHARED_PLANETOID.is_dir(), reason="shared data folder not present")
def test_explicit_root_equals_bundled(cora):
    other = load_planetoid("cora", root=SHARED_PLANETOID)
    for field in ("x", "y", "edge_index"):
        assert torch.equal(getattr(other, field), getattr(cora, field))


def test_pyg_folder_layout(tmp_path, cora):
    raw = tmp_path / "Cora" / "raw"
    raw.mkdir(parents=True)
    for part in PLANETOID_PARTS:
        shutil.copy(DATA_DIR / f"ind.cora.{part}", raw)
    assert torch.equal(load_planetoid("cora", root=tmp_path).edge_index, cora.edge_index)


def test_missing_file_is_named(tmp_path):
    for part in PLANETOID_PARTS:
        if part != "ty":
            shutil.copy(DATA_DIR / f"ind.cora.{part}", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"ind\.cora\.ty"):
        load_planetoid("cora", root=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"ind\.citeseer\.x"):
        load_planetoid("citeseer", root=tmp_path / "nowhere")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adjacency_layouts_agree(cora, dtype):
    dense = cora.adjacency("dense", dtype=dtype)
    assert dense.dtype == dtype and torch.equal(dense, dense.T)
    assert dense.sum() == 10556 and dense.diagonal().sum() == 0
    csr, coo, csc = (cora.adjacency(layout, dtype=dtype) for layout in ("csr", "coo", "csc"))
    assert csr.layout == torch.sparse_csr and csc.layout == torch.sparse_csc
    assert coo.layout == torch.sparse_coo and coo.is_coalesced()
    for adj in (csr, coo, csc):
        assert adj.dtype == dtype and torch.equal(adj.to_dense(), dense)
    bsr = cora.adjacency("bsr", block=4, dtype=dtype)  # 2708 = 4 * 677
    assert bsr.layout == torch.sparse_bsr and torch.equal(bsr.to_dense(), dense)


def test_bsr_padding(cora):
    with pytest.raises(ValueError, match="pad=True"):
        cora.adjacency("bsr", block=16)
    padded = cora.adjacency("bsr", block=16, pad=True).to_dense()
    assert padded.shape == (2720, 2720)
    assert torch.equal(padded[:2708, :2708], cora.adjacency("dense"))
    assert padded[2708:].sum() == 0 and padded[:, 2708:].sum() == 0
    with pytest.raises(ValueError, match="layout"):
        cora.adjacency("ell")


def test_karate_and_tiny():
    karate = load_dataset("karate")
    assert karate.num_nodes == 34 and karate.num_undirected_edges() == 78
    assert torch.equal(karate.x, torch.eye(34)) and karate.y.sum() == 17
    assert_canonical(karate.edge_index, 34)
    tiny, again = load_dataset("tiny"), load_dataset("tiny")
    assert tiny.synthetic and tiny.num_nodes == 64 and tiny.num_features == 16
    assert torch.equal(tiny.edge_index, again.edge_index) and torch.equal(tiny.x, again.x)


@pytest.mark.parametrize("name", ["cora-ml-synthetic", "dblp-synthetic", "collab-synthetic"])
def test_synthetic_standins(name):
    info = DATASETS[name]
    data = load_dataset(name)
    assert data.synthetic and "synthetic" in data.name and info.synthetic
    assert data.num_nodes == info.num_nodes
    assert abs(data.num_undirected_edges() - info.num_edges) <= 0.02 * info.num_edges
    assert data.x.shape == (info.num_nodes, 128) and data.x.dtype == torch.float32
    assert_canonical(data.edge_index, data.num_nodes)
    deg = data.degrees().float()
    assert deg.max() > 20 * deg.mean()  # heavy tail: hubs far above the mean
    assert (deg <= 2 * deg.mean()).float().mean() > 0.6  # ... while most nodes are small


def test_synthetic_seeding_and_features():
    a = synthetic_powerlaw(500, 2000, num_features=7, seed=3)
    b = synthetic_powerlaw(500, 2000, num_features=7, seed=3)
    c = synthetic_powerlaw(500, 2000, num_features=7, seed=4)
    assert torch.equal(a.edge_index, b.edge_index) and torch.equal(a.x, b.x)
    assert not torch.equal(a.edge_index, c.edge_index)
    assert a.x.shape == (500, 7) and a.y is None
    assert load_dataset("dblp-synthetic", feature_dim=32).num_features == 32
    with pytest.raises(ValueError):
        synthetic_powerlaw(4, 7)  # more edges than a simple 4-node graph holds


def test_registry_errors():
    with pytest.raises(KeyError, match="known"):
        load_dataset("ogbn-papers100m")
    with pytest.raises(ValueError, match="1433"):
        load_dataset("cora", feature_dim=64)
    assert {"cora", "karate", "tiny", "mag-synthetic", "arxiv-synthetic"} <= set(DATASETS)
