"""Fibertree storage (spec/dataflow.md, "Tensor storage").

A tensor is stored level by level in its mode order: a dense level is only its size, a
compressed level has `seg` (fibers + 1) and `crd`. Positions are refs: a compressed child
ref is the position in `crd`, a dense child ref is `parent_ref * size + c`. `values` is
indexed by the last level's ref. With sparsity blocking the coordinates are block indices
and every value is a dense tile (shape `tile`, one axis per blocked level).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

DENSE, COMPRESSED = "d", "c"


@dataclass(frozen=True, eq=False)
class LevelData:
    kind: str
    size: int  # number of coordinates (blocks when blocked)
    seg: np.ndarray | None = None
    crd: np.ndarray | None = None

    def __str__(self) -> str:
        if self.kind == DENSE:
            return f"dense({self.size})"
        return f"compressed({self.size}, nnz={len(self.crd)})"


@dataclass(frozen=True, eq=False)
class Storage:
    levels: tuple[LevelData, ...]
    values: np.ndarray  # (positions,) or (positions, *tile)
    tile: tuple[int, ...] = ()  # tile size per level (1 = not blocked); () = scalar values

    @property
    def nnz(self) -> int:
        return int(self.values.shape[0])

    def __str__(self) -> str:
        tile = f" tiles {self.tile}" if self.tile else ""
        return "[" + ", ".join(map(str, self.levels)) + f"] {self.nnz} values{tile}"


def _tile_axes(tile) -> tuple[int, ...]:
    return tuple(t for t in tile if t > 1)


def from_dense(array: np.ndarray, kinds: tuple[str, ...], tile: tuple[int, ...] = (),
               owned: bool = False) -> Storage:
    """Store an array whose axes are already in level order. `owned`: a float64 array that no one
    else holds (from_torch's), stored as it is where it is C-contiguous."""
    array = np.asarray(array, dtype=np.float64)
    if tile and any(t > 1 for t in tile):
        return _from_dense_blocked(array, kinds, tuple(tile))
    if all(k == DENSE for k in kinds):
        levels = tuple(LevelData(DENSE, int(n)) for n in array.shape)
        if owned and array.flags.c_contiguous:
            return Storage(levels, array.reshape(-1))
        # one copy in C order (reshape(-1) copies a transposed array: a .copy() after it made two)
        return Storage(levels, np.array(array, order="C").reshape(-1))
    coords = np.stack(np.nonzero(array), axis=1) if array.ndim else np.zeros((1, 0), np.int64)
    values = array[tuple(coords.T)] if array.ndim else array.reshape(1)
    return from_coo(coords, values, tuple(array.shape), kinds)


def _from_dense_blocked(array, kinds, tile) -> Storage:
    """Blocks of `tile` become the values; a block is stored when any entry is non-zero
    (dense levels store every block). An extent that is not a multiple of its tile is padded
    with zeros."""
    rank = array.ndim
    nblocks = tuple(-(-n // t) for n, t in zip(array.shape, tile))
    if any(nb * t != n for nb, t, n in zip(nblocks, tile, array.shape)):  # zero padding to whole tiles
        array = np.pad(array, [(0, nb * t - n) for nb, t, n in zip(nblocks, tile, array.shape)])
    shaped = array.reshape(tuple(x for nb, t in zip(nblocks, tile) for x in (nb, t)))
    blocks = shaped.transpose(tuple(range(0, 2 * rank, 2)) + tuple(range(1, 2 * rank, 2)))
    tiles = blocks.reshape(nblocks + _tile_axes(tile))
    if all(k == DENSE for k in kinds):
        levels = tuple(LevelData(DENSE, n) for n in nblocks)
        return Storage(levels, tiles.reshape((-1,) + _tile_axes(tile)).copy(), tile)
    nz = np.abs(tiles).reshape(nblocks + (-1,)).max(axis=-1) != 0
    coords = np.stack(np.nonzero(nz), axis=1)
    return from_coo(coords, tiles[tuple(coords.T)], nblocks, kinds, tile)


def from_coo(coords: np.ndarray, values: np.ndarray, sizes: tuple[int, ...], kinds: tuple[str, ...],
             tile: tuple[int, ...] = (), presorted: bool = False) -> Storage:
    """Store unique coordinates (nnz × levels, in level order) with their values; dense
    levels get every coordinate and the missing values are zero."""
    coords = np.asarray(coords, dtype=np.int64).reshape(len(values), len(kinds))
    values = np.asarray(values, dtype=np.float64)
    if len(kinds) and not presorted:
        order = np.lexsort(coords.T[::-1]) if len(coords) else np.zeros(0, np.int64)
        coords, values = coords[order], values[order]
    pos = np.zeros(len(values), np.int64)
    count = 1
    levels = []
    for lv, (kind, size) in enumerate(zip(kinds, sizes)):
        c = coords[:, lv]
        if kind == DENSE:
            pos = pos * size + c
            count *= size
            levels.append(LevelData(DENSE, int(size)))
            continue
        new = np.ones(len(c), bool)
        if len(c) > 1:
            new[1:] = (pos[1:] != pos[:-1]) | (c[1:] != c[:-1])
        pair_pos = pos[new]
        seg = np.searchsorted(pair_pos, np.arange(count + 1), side="left").astype(np.int64)
        levels.append(LevelData(COMPRESSED, int(size), seg, c[new].copy()))
        pos = np.cumsum(new) - 1
        count = int(new.sum())
    out = np.zeros((count,) + values.shape[1:], np.float64)
    out[pos] = values
    return Storage(tuple(levels), out, tuple(tile))


def coords_of_positions(st: Storage) -> np.ndarray:
    """The coordinates (positions × levels) of every value position of a storage."""
    parents = np.zeros(1, np.int64)
    cols: list[np.ndarray] = []
    for lv in st.levels:
        if lv.kind == DENSE:
            c = np.tile(np.arange(lv.size), len(parents))
            rep = lv.size
            cols = [np.repeat(x, rep) for x in cols]
            cols.append(c)
            parents = np.arange(len(c))
        else:
            lens = np.diff(lv.seg)[parents] if len(parents) else np.zeros(0, np.int64)
            cols = [np.repeat(x, lens) for x in cols]
            cols.append(lv.crd.copy())
            parents = np.arange(len(lv.crd))
    return np.stack(cols, axis=1) if cols else np.zeros((len(st.values), 0), np.int64)


def to_dense(st: Storage, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Dense array in level order (for tests and inspection)."""
    coords = coords_of_positions(st)
    tile_full = st.tile or (1,) * len(st.levels)
    sizes = tuple(lv.size * t for lv, t in zip(st.levels, tile_full))
    out = np.zeros(shape or sizes, np.float64)
    if not st.tile:
        if len(st.levels):
            out[tuple(coords.T)] = st.values
        else:
            out[...] = st.values[0]
        return out
    full = st.values.reshape((len(st.values),) + tuple(tile_full))
    for pos in range(len(st.values)):
        sl = tuple(slice(c * t, (c + 1) * t) for c, t in zip(coords[pos], tile_full))
        out[sl] = full[pos]
    return out


# ---------------------------------------------------------------- from torch

def torch_coo(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Coordinates (nnz × modes) and values of the stored entries of a torch tensor; a dense
    tensor stores its non-zeros."""
    if t.layout == torch.strided:
        nz = torch.nonzero(t).numpy()
        return nz.astype(np.int64), t.detach().double().numpy()[tuple(nz.T)] if len(nz) else np.zeros(0)
    coo = t.to_sparse_coo().coalesce() if t.layout != torch.sparse_coo else t.coalesce()
    return coo.indices().T.numpy().astype(np.int64), coo.values().detach().double().numpy()


def dense_numpy(t: torch.Tensor, mode_order: tuple[int, ...] | None = None) -> np.ndarray:
    """t as a float64 array; with `mode_order`, a new C-contiguous one with t's modes in that order,
    permuted and converted in one pass (a 736,389 x 349 float32 tensor stored column first took
    three 2 GB float64 copies: converted, then transposed twice by from_dense)."""
    if t.layout != torch.strided:
        t = t.to_dense()
    if mode_order is not None:
        return t.detach().permute(mode_order).to(torch.float64, memory_format=torch.contiguous_format,
                                                 copy=True).numpy()
    return t.detach().to(torch.float64).numpy() if t.dtype != torch.bool else t.numpy().astype(np.float64)


def from_torch(t: torch.Tensor, kinds: tuple[str, ...], mode_order: tuple[int, ...],
               tile: tuple[int, ...] = ()) -> Storage:
    """Store a torch tensor (dense or sparse) with its modes in `mode_order` as the levels."""
    if t.dtype == torch.bool:
        t = t.to(torch.float64)
    blocked = bool(tile) and any(x > 1 for x in tile)
    if all(k == DENSE for k in kinds) or blocked:
        return from_dense(dense_numpy(t, tuple(mode_order)), kinds, tile, owned=True)
    coords, values = torch_coo(t)
    sizes = tuple(int(t.shape[m]) for m in mode_order)
    return from_coo(coords[:, list(mode_order)], values, sizes, kinds)
