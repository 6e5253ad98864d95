"""Graph data for the GNN workloads: the bundled Cora set and seeded synthetic stand-ins.

FuseFlow evaluates GCN and GraphSAGE on Cora, Cora-ML, DBLP, ogbl-collab and ogbn-mag. Only
Cora ships with the repository (raw Planetoid files in ``data/``); the others cannot be
downloaded here, so they are replaced by Chung–Lu power-law graphs with the real sets' node
and edge counts, and named ``*-synthetic`` so that no result is mistaken for the real data.

Every graph is held in one canonical form (symmetric, no self loops, no duplicates, edges
sorted row-major) so that its CSR, COO, CSC, BSR and dense adjacencies all agree and the
compiler sees the same sparsity pattern whichever format a test picks.
"""

from __future__ import annotations

import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

#: Where the bundled Planetoid files live (package data, see pyproject's package-data).
DATA_DIR = Path(__file__).resolve().parent / "data"
PLANETOID_PARTS = ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")
DENSE_LIMIT_BYTES = 1 << 32


@dataclass(frozen=True, eq=False)
class GraphData:
    """One graph in canonical form; ``eq=False`` because tensors have no boolean equality."""

    name: str
    num_nodes: int
    edge_index: torch.Tensor  # (2, E) int64: symmetric, no self loops, unique, row-major sorted
    x: torch.Tensor  # (N, F) float32 node features
    y: torch.Tensor | None  # (N,) int64 labels, where the data set has them
    synthetic: bool

    @property
    def num_features(self) -> int:
        return int(self.x.shape[1])

    def num_edges(self) -> int:
        """Directed edge count (each undirected edge counted twice), as PyG reports it."""
        return int(self.edge_index.shape[1])

    def num_undirected_edges(self) -> int:
        return self.num_edges() // 2

    def degrees(self) -> torch.Tensor:
        return torch.bincount(self.edge_index[0], minlength=self.num_nodes)

    def adjacency(self, layout: str = "csr", block: int | tuple[int, int] | None = None,
                  dtype: torch.dtype = torch.float32, pad: bool = False) -> torch.Tensor:
        """The 0/1 adjacency (no normalisation, no self loops), as FuseFlow's GNNs consume it.

        ``layout`` is one of "csr", "coo" (coalesced), "csc", "dense" or "bsr"; "bsr" needs
        ``block`` (an int or a (rows, cols) pair) and, unless ``pad`` is set, a node count
        divisible by it — padding changes the shape, so it must be asked for explicitly.
        """
        n = self.num_nodes
        if layout == "coo":
            vals = torch.ones(self.num_edges(), dtype=dtype)
            return torch.sparse_coo_tensor(self.edge_index, vals, (n, n), is_coalesced=True,
                                           check_invariants=False)
        if layout == "csr":
            return self._csr(n, dtype)
        if layout == "csc":
            return self._csr(n, dtype).to_sparse_csc()
        if layout == "dense":
            if n * n * torch.finfo(dtype).bits // 8 > DENSE_LIMIT_BYTES:
                raise ValueError(f"dense adjacency of {self.name} ({n} nodes) exceeds 4 GiB")
            dense = torch.zeros(n, n, dtype=dtype)
            dense[self.edge_index[0], self.edge_index[1]] = 1
            return dense
        if layout == "bsr":
            return self._bsr(block, dtype, pad)
        raise ValueError(f"unknown layout {layout!r}: use csr, coo, csc, dense or bsr")

    def _csr(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """CSR straight from the sorted edge list: no conversion pass, fast for 10M edges."""
        crow = torch.zeros(n + 1, dtype=torch.int64)
        crow[1:] = torch.cumsum(torch.bincount(self.edge_index[0], minlength=n), 0)
        vals = torch.ones(self.num_edges(), dtype=dtype)
        with warnings.catch_warnings():  # torch's "sparse CSR is in beta" notice, every call
            warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support.*")
            return torch.sparse_csr_tensor(crow, self.edge_index[1].clone(), vals, (n, n),
                                           check_invariants=False)

    def _bsr(self, block, dtype: torch.dtype, pad: bool) -> torch.Tensor:
        if block is None:
            raise ValueError("layout='bsr' needs block=(rows, cols) or an int")
        bh, bw = (block, block) if isinstance(block, int) else tuple(block)
        n = self.num_nodes
        rows, cols = -(-n // bh) * bh, -(-n // bw) * bw
        if (rows, cols) != (n, n) and not pad:
            raise ValueError(f"{n} nodes are not divisible by block {(bh, bw)}; pass pad=True "
                             f"for a zero-padded ({rows}, {cols}) adjacency")
        vals = torch.ones(self.num_edges(), dtype=dtype)
        coo = torch.sparse_coo_tensor(self.edge_index, vals, (rows, cols), is_coalesced=True,
                                      check_invariants=False)
        return coo.to_sparse_csr().to_sparse_bsr((bh, bw))


def canonical_edge_index(row: np.ndarray, col: np.ndarray, num_nodes: int) -> torch.Tensor:
    """Symmetrise, drop self loops and duplicates, sort row-major; returns (2, E) int64."""
    row, col = np.asarray(row, dtype=np.int64), np.asarray(col, dtype=np.int64)
    keep = row != col
    row, col = row[keep], col[keep]
    keys = np.unique(np.concatenate([row * num_nodes + col, col * num_nodes + row]))
    return torch.from_numpy(np.stack([keys // num_nodes, keys % num_nodes]))


# ----------------------------------------------------------------------------- Planetoid


def _planetoid_dir(name: str, root: str | Path | None) -> Path:
    """Accept the raw folder itself or PyG's ``root/<Name>/raw`` layout under it."""
    base = DATA_DIR if root is None else Path(root)
    for cand in (base, base / name, base / name / "raw", base / name.capitalize() / "raw",
                 base / name.capitalize()):
        if (cand / f"ind.{name}.x").is_file():
            return cand
    return base


def _read_part(folder: Path, name: str, part: str):
    path = folder / f"ind.{name}.{part}"
    if not path.is_file():
        raise FileNotFoundError(f"Planetoid file {path} is missing (need ind.{name}.<part> for "
                                f"parts {', '.join(PLANETOID_PARTS)})")
    if part == "test.index":
        return np.array([int(s) for s in path.read_text().split()], dtype=np.int64)
    with path.open("rb") as f, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # old scipy pickles warn about moved module names
        out = pickle.load(f, encoding="latin1")
    if part == "graph":
        return out
    return np.asarray(out.todense() if hasattr(out, "todense") else out, dtype=np.float32)


def load_planetoid(name: str = "cora", root: str | Path | None = None) -> GraphData:
    """Read the raw Planetoid split exactly as Kipf's GCN code and PyG's reader do.

    The test rows (``tx``/``ty``) are stored in a shuffled order given by ``test.index``;
    they are appended after ``allx`` and then moved to their listed node ids. Citeseer
    has isolated test ids with no row, padded here with zeros as PyG does.
    """
    name = name.lower()
    folder = _planetoid_dir(name, root)
    x, tx, allx, y, ty, ally, graph, test_index = (
        _read_part(folder, name, p) for p in PLANETOID_PARTS)
    del x, y  # the training rows are the first rows of allx/ally already
    sorted_test = np.sort(test_index)
    if name == "citeseer":
        span = int(test_index.max() - test_index.min()) + 1
        tx, ty = _pad_rows(tx, sorted_test - test_index.min(), span), \
            _pad_rows(ty, sorted_test - test_index.min(), span)
    feats = np.concatenate([allx, tx])
    labels = np.concatenate([ally, ty]).argmax(1)
    feats[test_index], labels[test_index] = feats[sorted_test], labels[sorted_test]
    n = labels.shape[0]
    row = np.concatenate([np.full(len(v), k, dtype=np.int64) for k, v in graph.items()])
    col = np.concatenate([np.asarray(v, dtype=np.int64) for v in graph.values()])
    inside = (row < n) & (col < n)  # NELL-style dangling ids would fall outside; Cora has none
    return GraphData(name=name, num_nodes=n,
                     edge_index=canonical_edge_index(row[inside], col[inside], n),
                     x=torch.from_numpy(feats), y=torch.from_numpy(labels.astype(np.int64)),
                     synthetic=False)


def _iid_endpoints(probs: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` i.i.d. node draws from ``probs``: a multinomial histogram, expanded, shuffled.

    Same distribution as ``rng.choice(len(probs), count, p=probs)`` but ~8x faster at 10M
    draws, because it avoids a cache-missing binary search per draw.
    """
    ends = np.repeat(np.arange(probs.size, dtype=np.int64), rng.multinomial(count, probs))
    rng.shuffle(ends)
    return ends


def _pad_rows(rows: np.ndarray, at: np.ndarray, length: int) -> np.ndarray:
    out = np.zeros((length, rows.shape[1]), dtype=rows.dtype)
    out[at] = rows
    return out


# ----------------------------------------------------------------------------- synthetic


def synthetic_powerlaw(num_nodes: int, num_edges: int, num_features: int = 128, seed: int = 0,
                       exponent: float = 2.5, name: str = "synthetic-powerlaw") -> GraphData:
    """A Chung–Lu graph: ``num_nodes`` nodes, ``num_edges`` undirected edges, P(k) ~ k^-exponent.

    Endpoints are drawn independently with probability proportional to a Zipf weight, so the
    expected degrees follow the power law; duplicate pairs and self loops are discarded and
    topped up in rounds until the exact edge count is reached (a surplus is dropped at random).
    Node ids are shuffled so that hubs are not all at the front, as in real data sets.
    """
    if exponent <= 1.0:
        raise ValueError(f"the power-law exponent must exceed 1, got {exponent}")
    if num_edges > num_nodes * (num_nodes - 1) // 2:
        raise ValueError(f"{num_edges} edges do not fit in a simple graph of {num_nodes} nodes")
    rng = np.random.default_rng(seed)
    weights = np.arange(1, num_nodes + 1, dtype=np.float64) ** (-1.0 / (exponent - 1.0))
    probs = weights / weights.sum()
    keys = np.empty(0, dtype=np.int64)
    for _ in range(64):
        missing = num_edges - keys.size
        if missing <= 0:
            break
        k = int(missing * 1.1) + 16
        u, v = _iid_endpoints(probs, 2 * k, rng).reshape(2, k)
        lo, hi = np.minimum(u, v), np.maximum(u, v)
        keys = np.unique(np.concatenate([keys, (lo * num_nodes + hi)[lo != hi]]))
    if keys.size < num_edges:
        raise RuntimeError(f"could not place {num_edges} edges; lower the exponent")
    keys = keys[np.sort(rng.choice(keys.size, num_edges, replace=False))]
    perm = rng.permutation(num_nodes)
    gen = torch.Generator().manual_seed(seed)
    return GraphData(name=name, num_nodes=num_nodes,
                     edge_index=canonical_edge_index(perm[keys // num_nodes],
                                                     perm[keys % num_nodes], num_nodes),
                     x=torch.randn(num_nodes, num_features, generator=gen), y=None,
                     synthetic=True)


# ----------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class DatasetInfo:
    """What a registry name stands for: sizes of the real set and how we obtain it here."""

    name: str
    num_nodes: int
    num_edges: int  # undirected
    description: str
    synthetic: bool
    loader: Callable[[int | None, int], GraphData]


def _cora(feature_dim: int | None, seed: int) -> GraphData:
    data = load_planetoid("cora")
    if feature_dim not in (None, data.num_features):
        raise ValueError(f"cora has {data.num_features} real features; feature_dim={feature_dim}"
                         " would replace them — use a synthetic set for other widths")
    return data


def _karate(feature_dim: int | None, seed: int) -> GraphData:
    """Zachary's karate club: FuseFlow's dataflow-order study runs on it. One-hot features."""
    import networkx as nx

    g = nx.karate_club_graph()
    edges = np.array(list(g.edges()), dtype=np.int64).T
    n = g.number_of_nodes()
    y = torch.tensor([0 if g.nodes[i]["club"] == "Mr. Hi" else 1 for i in range(n)])
    if feature_dim is None:
        x = torch.eye(n)
    else:
        x = torch.randn(n, feature_dim, generator=torch.Generator().manual_seed(seed))
    return GraphData("karate", n, canonical_edge_index(edges[0], edges[1], n), x, y, False)


def _synthetic(name: str, nodes: int, edges: int, default_dim: int = 128):
    def load(feature_dim: int | None, seed: int) -> GraphData:
        return synthetic_powerlaw(nodes, edges, feature_dim or default_dim, seed=seed, name=name)
    return load


def _info(name, nodes, edges, desc, synthetic, loader=None, dim=128) -> DatasetInfo:
    return DatasetInfo(name, nodes, edges, desc, synthetic,
                       loader or _synthetic(name, nodes, edges, dim))


DATASETS: dict[str, DatasetInfo] = {d.name: d for d in (
    _info("cora", 2708, 5278, "Cora citation graph, real Planetoid files (bundled)", False, _cora),
    _info("karate", 34, 78, "Zachary's karate club (networkx)", False, _karate),
    _info("tiny", 64, 192, "small deterministic power-law graph for tests", True, dim=16),
    _info("cora-ml-synthetic", 2995, 8158, "stand-in for Cora-ML", True),
    _info("dblp-synthetic", 17716, 52867, "stand-in for CitationFull DBLP", True),
    _info("collab-synthetic", 235868, 1285465, "stand-in for ogbl-collab", True),
    _info("mag-synthetic", 736389, 5416271, "stand-in for ogbn-mag paper-cites-paper", True),
    _info("arxiv-synthetic", 169343, 1166243, "stand-in for ogbn-arxiv", True),
)}


def load_dataset(name: str, feature_dim: int | None = None, seed: int = 0) -> GraphData:
    """Load a registry graph by name; ``seed`` fixes synthetic structure and features."""
    try:
        info = DATASETS[name]
    except KeyError:
        raise KeyError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}") from None
    return info.loader(feature_dim, seed)
