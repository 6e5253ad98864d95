"""Which tiles the block-sparse attention kernel visits: the folded offset map and the tile plan.

The score transform is t(s) = a·s + b[l, m] (attention.py folds it at compile time). `BlockMap`
keeps b by 16×16 blocks, each dropped (every position -inf), uniform (every position kept, one
value) or mixed (its 256 values stored), so that a long context's map costs memory for its mixed
blocks only: a BigBird mask at S = 16384 is 2^20 block entries, not 2^28 offsets. `tile_plan` cuts
the map into the kernel's BM×BN tiles (multiples of the block), keeps per query tile the key tiles
that hold a kept position, and lists them as work items (`work_items`: a long query tile split into
runs, longest first).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterable

import torch

LOG2E = 1.0 / math.log(2.0)
BLOCK = 16    # the side of BlockMap's blocks: every tile side is a multiple of it
MAX_TILE = 128  # the largest tile side; a map is padded to a multiple of it
DROPPED, UNIFORM, MIXED = 0, 1, 2


@dataclass(frozen=True)
class AttentionTiles:
    bm: int = 64
    bn: int = 64
    num_warps: int = 4
    num_stages: int = 2
    chunk: int = 0  # at most this many key tiles per program (a longer query tile is split); 0: no split

    def __str__(self) -> str:
        split = f" c{self.chunk}" if self.chunk else ""
        return f"bm{self.bm} bn{self.bn} w{self.num_warps} s{self.num_stages}{split}"

    def chunked(self, chunk: int) -> "AttentionTiles":
        return AttentionTiles(self.bm, self.bn, self.num_warps, self.num_stages, chunk)


@dataclass(frozen=True, eq=False)
class TilePlan:
    """Which key tiles each query tile visits, and with which offsets (tensors on one device).

    The score transform is s·a + b with one a for the whole attention (`scale`, log2(e) folded in).
    A *uniform* tile (every position kept, one b) adds its `shift`; a *partial* tile (some positions
    dropped, or b varies) loads b per position from `offsets` (-inf where dropped). The kernel walks
    a query tile's partial tiles, then its uniform ones, in two loops, so that the uniform tiles,
    most of a block mask's, pay nothing per position beyond dense attention."""

    tiles: AttentionTiles
    scale: float             # a·log2(e)
    start: torch.Tensor      # int32 [n_qtiles, 3]: where a query tile's partial tiles start, its uniform ones, the end
    column: torch.Tensor     # int32 [n_tiles]: key-tile index, ascending within each kind of a query tile
    slot: torch.Tensor       # int32 [n_tiles]: row of `offsets` (a partial tile), 0 (a uniform one)
    shift: torch.Tensor      # fp32 [n_tiles]: b·log2(e) of a uniform tile
    offsets: torch.Tensor    # [n_partial, BM, BN]: b·log2(e) per position, -inf where dropped; fp32, or bf16
                             # when asked for and every value is exact in it (a 0/1 mask's 0 and -inf)
    items: torch.Tensor      # int32 [n_items, 5]: query tile, first partial, first uniform, end, scratch part
                             # (-1: the item is the whole query tile), longest first
    merges: torch.Tensor     # int32 [n_split, 3]: a split query tile, its first scratch part, its part count
    parts: int = 0           # scratch slots per batch entry: the items of split query tiles (host-side, so
                             # that a launch reads nothing back from the device, as a CUDA-graph capture needs)
    longest: int = 0         # the most key tiles one query tile visits

    @property
    def visited(self) -> int:
        return int(self.column.numel())

    @property
    def partial(self) -> int:
        return int(self.offsets.shape[0])

    def to(self, device) -> "TilePlan":
        moved = {f: getattr(self, f).to(device) for f in TENSOR_FIELDS}
        return TilePlan(self.tiles, self.scale, **moved, parts=self.parts, longest=self.longest)

    def __str__(self) -> str:
        split = f", {self.merges.shape[0]} split into {self.parts} programs" if self.merges.numel() else ""
        return (f"{self.tiles}: {self.visited} tiles visited over {self.start.shape[0]} query tiles "
                f"({self.partial} partial{split})")


TENSOR_FIELDS = ("start", "column", "slot", "shift", "offsets", "items", "merges")
CHUNKS = (4, 8, 16, 32)  # runs the autotuner tries for a plan whose longest query tile is longer


def chunk_options(plan: TilePlan) -> tuple[int, ...]:
    """Splits worth timing: none, and each run length shorter than the plan's longest query tile. Measured
    on an H100 (scripts/attention_split_probe.py): BigBird at S=4096 runs fastest with runs of 16-32 (its
    global rows visit all 64 key tiles, the others about 7), FuseFlow's S=1024 with runs of 4-8 (192
    programs otherwise leave SMs idle), a dense plan without a split."""
    return (0, *(c for c in CHUNKS if c < plan.longest))


def work_items(start: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(items, merges) of TilePlan: each query tile's tile list [first, end) cut into runs of at most
    `chunk` tiles (as even as possible; chunk 0 cuts nothing), longest run first."""
    rows, merges, part = [], [], 0
    for qt, (first, uniform, end) in enumerate(start.tolist()):
        n = end - first
        pieces = max(1, -(-n // chunk)) if chunk else 1
        if pieces == 1:
            rows.append((qt, first, uniform, end, -1))
            continue
        merges.append((qt, part, pieces))
        bounds = [first + n * i // pieces for i in range(pieces + 1)]
        for i in range(pieces):
            lo, hi = bounds[i], bounds[i + 1]
            rows.append((qt, lo, min(max(uniform, lo), hi), hi, part + i))
        part += pieces
    rows.sort(key=lambda r: (r[1] - r[3], r[0]))  # longest first (a stable LPT order)
    items = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)
    return items, torch.tensor(merges, dtype=torch.int32).reshape(-1, 3)


@dataclass(frozen=True, eq=False)
class BlockMap:
    """The offset map b [S_q, S_k] by BLOCK×BLOCK blocks, padded to multiples of MAX_TILE: rows past S_q
    repeat the last row (they are never stored, and must not turn a uniform tile partial), columns past
    S_k are dropped."""

    s_q: int
    s_k: int
    kind: torch.Tensor   # int8 [rows / BLOCK, cols / BLOCK]: DROPPED, UNIFORM or MIXED
    value: torch.Tensor  # float32, same shape: a uniform block's offset (0 elsewhere)
    slot: torch.Tensor   # int64, same shape: a mixed block's index in `mixed` (-1 elsewhere)
    mixed: torch.Tensor  # float32 [n_mixed, BLOCK, BLOCK]: the mixed blocks' offsets, -inf where dropped
    kept: int            # positions kept, of s_q·s_k

    def dense(self) -> torch.Tensor:
        """b itself, [S_q, S_k] (for tests and small maps)."""
        nq, nk = self.kind.shape
        blocks = _expand(self, torch.arange(nq)[:, None].expand(nq, nk), torch.arange(nk)[None, :].expand(nq, nk))
        return blocks.permute(0, 2, 1, 3).reshape(nq * BLOCK, nk * BLOCK)[:self.s_q, :self.s_k]

    def digest(self) -> str:
        h = hashlib.sha1()
        for t in (self.kind, self.value, self.slot, self.mixed):
            h.update(t.contiguous().numpy().tobytes())
        h.update(f"{self.s_q}x{self.s_k}".encode())
        return h.hexdigest()[:16]


def _expand(m: BlockMap, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
    """The blocks at (qi, ki) as offsets [..., BLOCK, BLOCK]."""
    kind, value, slot = m.kind[qi, ki], m.value[qi, ki], m.slot[qi, ki]
    stored = m.mixed if m.mixed.shape[0] else torch.zeros(1, BLOCK, BLOCK)
    out = stored[slot.clamp(min=0)].clone()
    out[kind == UNIFORM] = value[kind == UNIFORM][:, None, None].expand(-1, BLOCK, BLOCK)
    out[kind == DROPPED] = float("-inf")
    return out


def _padded_extent(n: int) -> int:
    return -(-n // MAX_TILE) * MAX_TILE


def block_map(bands: Iterable[tuple[int, torch.Tensor]], s_q: int, s_k: int) -> BlockMap:
    """A BlockMap from bands of b's rows, (first row, [rows, S_k] float), in order, covering [0, S_q); every
    band but the last a multiple of BLOCK rows long."""
    parts, kept, covered, last, n_mixed = [], 0, 0, None, 0  # parts: (kind, value, slot, mixed) per band
    cols = _padded_extent(s_k)

    def add(padded: torch.Tensor) -> None:
        nonlocal n_mixed
        parts.append(_classify(padded, n_mixed))
        n_mixed += parts[-1][3].shape[0]

    for r0, band in bands:
        if r0 != covered or covered % BLOCK:
            raise ValueError(f"a band starts at row {r0} after {covered} rows: bands must be in order, each but "
                             f"the last a multiple of {BLOCK} rows")
        band = band.float()
        kept += int((~torch.isneginf(band)).sum())
        covered, last = r0 + band.shape[0], band[-1]
        add(_pad(band, cols))
    rows = -(-covered // BLOCK) * BLOCK
    if rows < _padded_extent(s_q):  # whole blocks of the last row up to the padded extent
        add(_pad(last.expand(_padded_extent(s_q) - rows, -1), cols))
    kind, value, slot, mixed = (torch.cat(t) for t in zip(*parts))
    return BlockMap(s_q, s_k, kind, value, slot, mixed, kept)


def dense_block_map(b: torch.Tensor) -> BlockMap:
    """A BlockMap of a whole offset map [S_q, S_k]."""
    s_q, s_k = b.shape
    return block_map(((r0, b[r0:r0 + MAX_TILE]) for r0 in range(0, s_q, MAX_TILE)), s_q, s_k)


def _pad(band: torch.Tensor, cols: int) -> torch.Tensor:
    """Rows up to a multiple of BLOCK (repeating the band's last row), columns up to `cols` (dropped)."""
    rows = -(-band.shape[0] // BLOCK) * BLOCK
    out = torch.full((rows, cols), float("-inf"), dtype=torch.float32)
    out[:band.shape[0], :band.shape[1]] = band
    out[band.shape[0]:, :band.shape[1]] = band[-1]
    return out


def _classify(band: torch.Tensor, first_slot: int):
    """(kind, value, slot, mixed blocks) of a padded band."""
    rows, cols = band.shape
    blocks = band.view(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK).permute(0, 2, 1, 3)
    flat = blocks.flatten(2)
    dropped = torch.isneginf(flat)
    first = flat[..., 0]
    uniform = ~dropped.any(-1) & (flat == first[..., None]).all(-1)
    kind = torch.full(first.shape, MIXED, dtype=torch.int8)
    kind[uniform] = UNIFORM
    kind[dropped.all(-1)] = DROPPED
    is_mixed = kind == MIXED
    slot = torch.full(first.shape, -1, dtype=torch.int64)
    slot[is_mixed] = first_slot + torch.arange(int(is_mixed.sum()))
    return kind, torch.where(uniform, first, 0.0), slot, blocks[is_mixed].contiguous()


def tile_plan(scale: float, b: "BlockMap | torch.Tensor", tiles: AttentionTiles, narrow: bool = False) -> TilePlan:
    """Cut the offset map (a BlockMap, or b itself [S_q, S_k], -inf where dropped) into the tiles'
    BM×BN tiles; a = `scale` everywhere. `narrow`: partial tiles' offsets in bf16 where that is exact
    (half the bytes a partial tile loads: on an H100 with block-16 masks, S = 1024 23.4 -> 20.1 µs and
    S = 4096 140.6 -> 112.0, though most tile shapes then spill some registers; at head dim 128 and with
    fp32 operands they spill hundreds of bytes more, so the caller decides)."""
    m = b if isinstance(b, BlockMap) else dense_block_map(b)
    bm, bn = tiles.bm, tiles.bn
    if bm % BLOCK or bn % BLOCK or MAX_TILE % bm or MAX_TILE % bn:
        raise ValueError(f"tiles {tiles}: sides must be multiples of {BLOCK} dividing {MAX_TILE}")
    n_q, n_k = -(-m.s_q // bm), -(-m.s_k // bn)
    fq, fk = bm // BLOCK, bn // BLOCK
    kind = m.kind[:n_q * fq, :n_k * fk].view(n_q, fq, n_k, fk).permute(0, 2, 1, 3).flatten(2)
    value = m.value[:n_q * fq, :n_k * fk].view(n_q, fq, n_k, fk).permute(0, 2, 1, 3).flatten(2)
    visited = (kind != DROPPED).any(-1)
    first = value[..., 0]
    uniform = (kind == UNIFORM).all(-1) & (value == first[..., None]).all(-1)
    partial = visited & ~uniform
    # per query tile: partial tiles, then uniform ones, columns ascending within each; unvisited last
    order = torch.where(partial, 0, torch.where(uniform, 1, 2)) * n_k + torch.arange(n_k)
    ki = order.argsort(-1)
    qi = torch.arange(n_q)[:, None].expand(n_q, n_k)
    take = visited.gather(-1, ki)
    qi, ki = qi[take], ki[take]
    is_partial = partial[qi, ki]
    slot = torch.zeros(len(qi), dtype=torch.int32)
    slot[is_partial] = torch.arange(int(is_partial.sum()), dtype=torch.int32)
    counts = torch.stack([partial.sum(-1), uniform.sum(-1)], -1)
    start = torch.zeros(n_q, 3, dtype=torch.int64)
    start[:, 1:] = counts.cumsum(-1)
    start += (visited.sum(-1).cumsum(0) - visited.sum(-1))[:, None]
    shift = torch.where(is_partial, 0.0, first[qi, ki])
    items, merges = work_items(start, tiles.chunk)
    return TilePlan(tiles, scale * LOG2E, start.to(torch.int32).contiguous(), ki.to(torch.int32).contiguous(),
                    slot, (shift * LOG2E).contiguous(),
                    _partial_offsets(m, qi[is_partial], ki[is_partial], fq, fk, narrow),
                    items, merges, int(merges[:, 2].sum()), int(visited.sum(-1).max()))


def _partial_offsets(m: BlockMap, qi: torch.Tensor, ki: torch.Tensor, fq: int, fk: int,
                     narrow: bool) -> torch.Tensor:
    """The partial tiles' offsets [n, BM, BN], times log2(e), assembled from their blocks."""
    sub_q = qi[:, None, None] * fq + torch.arange(fq)[None, :, None]
    sub_k = ki[:, None, None] * fk + torch.arange(fk)[None, None, :]
    blocks = _expand(m, sub_q.expand(-1, fq, fk), sub_k.expand(-1, fq, fk))  # [n, fq, fk, BLOCK, BLOCK]
    tiles = (blocks.permute(0, 1, 3, 2, 4).reshape(len(qi), fq * BLOCK, fk * BLOCK) * LOG2E).contiguous()
    if narrow:
        half = tiles.to(torch.bfloat16)
        if torch.equal(half.float(), tiles):
            return half
    return tiles
