"""Adaptive thread mapping: tile shapes, rows per program, split rows, warps.

A config tiles a part's iteration space as [BP parallel points] x [BL local points] per step;
`split` cuts the local axes across that many programs (partial reductions then go through
global memory and a second launch; with `coop`, the programs of a row keep their pieces in
registers and meet at a barrier inside the one launch). `candidates` returns a small autotuning space, the
heuristic favourite first (the interpreter, and runs with autotuning off, take that one).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .analysis import PartPlan

MAX_ROW_IN_REGISTERS = 32768  # local elements one program keeps live (one chunk)
ELEMENTWISE_MAX_BL = 2048


@dataclass(frozen=True)
class Config:
    BP: int
    BL: int
    split: int = 1
    num_warps: int = 4
    persistent: int = 0  # >0: this many programs loop over the row blocks (rows stay L2-resident)
    prefetch: bool = False  # chunk loops load the next chunk before computing the current one
    coop: bool = False  # split rows meet at an in-kernel barrier, each piece held in registers (GPU only)
    tma: bool = False  # with coop and persistent: the next piece streams into shared memory by TMA (Hopper, Gluon)
    cp_async: bool = False  # the same by cp.async: any address pattern, 4-byte elements (Hopper, Gluon)
    cluster: bool = False  # plane or row statistics on thread-block clusters of `split` CTAs (cluster_planes, CUDA C++)

    def __str__(self) -> str:
        tail = f"_G{self.persistent}" if self.persistent else ""
        tail += "_PF" if self.prefetch else ""
        tail += "_C" if self.coop else ""
        tail += "_T" if self.tma else ""
        tail += "_A" if self.cp_async else ""
        tail += "_K" if self.cluster else ""
        return f"BP{self.BP}_BL{self.BL}_S{self.split}_W{self.num_warps}{tail}"


def pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_len(plan: PartPlan, cfg: Config) -> int:
    """Local elements each split handles: a multiple of BL, so chunks never straddle splits; a
    TMA-fed piece (one chunk, masked) is just its share, so that groups can fill every SM."""
    if cfg.tma:
        return cdiv(plan.L_total, cfg.split)
    return cdiv(cdiv(plan.L_total, cfg.split), cfg.BL) * cfg.BL


def n_chunks(plan: PartPlan, cfg: Config) -> int:
    return cdiv(min(split_len(plan, cfg), plan.L_total), cfg.BL)


def programs(plan: PartPlan, cfg: Config) -> int:
    blocks = cdiv(plan.P_total, cfg.BP)
    if cfg.persistent and cfg.coop:  # whole groups of `split` programs
        return cfg.split * min(blocks, cfg.persistent // cfg.split)
    if cfg.persistent:
        return min(blocks, cfg.persistent)
    return blocks * cfg.split


def phases(plan: PartPlan, cfg: Config) -> int:
    """Launches: one, unless split reductions must meet in global memory between stages."""
    if cfg.split > 1 and plan.reductions and not cfg.coop:
        return plan.final_stage + 1
    return 1


def coop_refusal(plan: PartPlan, cfg: Config) -> str | None:
    """Why a cooperative split cannot run this part (None: it can)."""
    if cfg.split < 2:
        return "a cooperative split needs split > 1"
    if cfg.persistent % cfg.split:
        return f"a persistent grid of {cfg.persistent} does not hold whole rows of {cfg.split} programs"
    if not plan.reductions or any(plan.stage[r.name] >= plan.final_stage for r in plan.reductions):
        return "every reduction must feed a later stage (per-row results alone use the phased split)"
    if (cfg.tma or cfg.cp_async) and not cfg.persistent:
        return "streamed pieces (tma, cp_async) need a persistent grid (programs walk the row blocks)"
    if cfg.persistent and n_chunks(plan, cfg) != 1:
        return (f"a persistent cooperative split prefetches whole pieces: {split_len(plan, cfg)} elements must be "
                f"one chunk of BL={cfg.BL}")
    return None


def max_coop_split(sms: int) -> int:
    """The most programs one row may be split over. All of them must run at once; a GPU holds at
    least one program per SM, and half the SMs leaves room for other streams' kernels (or an MPS
    share) without a row's programs waiting on each other forever. Persistent grids go further:
    they launch cooperatively (runtime.Launch), so the driver runs every program at once or
    refuses the launch."""
    return max(2, min(64, sms // 2))


def resident_per_sm(num_warps: int, registers: int, shared: int) -> int:
    """Programs one Hopper SM holds at once: 64 warps, 64K registers (allocated per warp in
    units of 256), 227 KB of shared memory (1 KB reserved per program), at most 32 programs."""
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = 65536 // max(1, per_warp * num_warps)
    by_smem = 233472 // (shared + 1024)
    return max(0, min(32, 64 // num_warps, by_regs, by_smem))


def _coop(plan: PartPlan, sms: int) -> list[Config]:
    """Long rows split over programs that each hold their piece in registers, so the row is read
    once, where a chunk loop reads it twice (the second time from L2 only while the rows in flight
    fit there). The programs of a row are adjacent in the grid and exchange their partial
    statistics through global memory at a barrier. Column reductions (the parallel axis
    contiguous) split their long reduced axis the same way, over tiles 32 columns wide.

    Options only, each slower on the H100 than these, so the autotuner does not try them:
    - a persistent grid (`persistent` with `coop`) walks the row blocks and loads its next piece
      while the current row waits: 10-40% slower (scripts/coop_try.py, BENCHMARKS.md);
    - pieces of several chunks (BL below the piece) hold one chunk at a time and read the piece
      again from L2 after each barrier (first reads evict_last, the last evict_first), so several
      programs share an SM: 8-40% slower (scripts/coop_reread_probe.py).
    Groups over `max_coop_split` programs (pinned by options) are checked against the compiled
    kernel's occupancy before launch (runtime.Launch).

    Column blocks also get TMA-fed configs (codegen_tma, Hopper only; the runtime drops them
    elsewhere): a persistent grid of whole groups, one or two programs per SM, whose next piece
    streams into shared memory while the current one waits."""
    out = []
    if os.environ.get("STITCHFLOW_COOP", "1") == "0":  # the escape hatch (README)
        return []
    if plan.p_contiguous:
        shapes = [(32, 1024, 16), (32, 1024, 8), (16, 2048, 16)]
    else:
        # not 32768 elements at 16 warps: 89 s to compile for ResNet-18's stem batch norm (H100 host), chosen nowhere
        shapes = [(1, 16384, 16), (1, 16384, 8), (1, 8192, 8), (1, 8192, 16), (1, 4096, 8), (1, 4096, 4)]
    for BP, BL, warps in shapes:
        split = cdiv(plan.L_total, BL)
        if 2 <= split <= max_coop_split(sms):
            cfg = dataclasses.replace(_fix(plan, BP, BL, split, warps), coop=True)
            if coop_refusal(plan, cfg) is None:
                out.append(cfg)
    out += _coop_tma(plan, sms) if plan.p_contiguous else _coop_planes(plan, sms)
    return out


def cp_async_configs(plan: PartPlan, sms: int) -> list[Config]:
    """Rows (and batch norm's channels) on a persistent grid of whole groups whose next piece
    streams into shared memory by cp.async while the current one waits (codegen_tma). An option,
    not in the autotuning space: the copies take a 64-bit address per element (and batch norm's
    are not provably contiguous, so they go 4 bytes at a time), and on the H100 every config was
    slower than the register-held split: batch norm 217-222 µs against 187, softmax_long_rows 492
    against 391 (the column blocks' TMA boxes have neither cost)."""
    out = []
    for BP, BL, warps, per_sm in ((1, 16384, 16, 1), (1, 8192, 8, 2), (1, 4096, 4, 2), (1, 4096, 8, 2)):
        slots, split = sms * per_sm, cdiv(plan.L_total, BL)
        if 2 <= split <= min(max_coop_split(sms), slots // 2):
            cfg = dataclasses.replace(_fix(plan, BP, BL, split, warps), coop=True,
                                      persistent=slots // split * split, cp_async=True)
            if cfg.BL == BL and coop_refusal(plan, cfg) is None:
                out.append(cfg)
    return out


def _coop_tma(plan: PartPlan, sms: int) -> list[Config]:
    """Persistent groups of TMA-fed pieces (codegen_tma), one or two programs per SM, each group
    the fewest programs whose pieces fit the tile. Widening the split until the groups fill every
    SM (pieces shorter than the tile, masked; a pinned `split` may do it) gained nothing on the
    H100: column_center 213.9 µs over 66 programs per group against 213.8 over 64 (4 of 132 SMs
    idle), column_standardize 276.7 against 229.3 (the masks made it spill). 16 warps on the same
    pieces: 214.7 and 239.8 against 213.0 and 229.0. One group over the whole GPU (a cooperative
    launch makes it safe) waits in step at every barrier: 32x512 pieces in one group of 128,
    237.4 against 212.9 µs."""
    out = []
    for BP, BL, warps, per_sm in ((32, 1024, 8, 1), (32, 512, 4, 2)):
        slots, split = sms * per_sm, cdiv(plan.L_total, BL)
        if 2 <= split <= slots // 2:
            cfg = dataclasses.replace(_fix(plan, BP, BL, split, warps), coop=True,
                                      persistent=slots // split * split, tma=True)
            if coop_refusal(plan, cfg) is None:
                out.append(cfg)
    return out


@dataclass(frozen=True)
class Planes:
    """A part whose reduced axes are (outer, *run), the run laid out contiguously in each input
    between the parallel axis and the outer one, as batch norm's (N, H, W) around C in NCHW:
    a TMA-fed piece (codegen_tma) is `pieces` whole planes of one channel, each one TMA box of
    [box_rows, cols] over the input seen as [N*C, rows, cols] (the box's rows past the plane
    arrive as zeros and are masked). Local points are numbered plane by plane with `pad` slots
    per plane, so a piece is one power-of-two register tile and needs no index math across
    planes."""
    outer: int  # the L axis class walked plane by plane
    run: tuple[int, ...]  # the L axis classes within a plane
    size: int  # elements of a plane
    cols: int  # the largest power of two dividing `size`, at most one box row (256)
    box_rows: int  # size // cols rounded up to a power of two
    pieces: int  # planes per piece

    @property
    def pad(self) -> int:
        return self.box_rows * self.cols

    def __str__(self) -> str:
        return f"{self.pieces} planes of {self.size // self.cols}x{self.cols} in boxes of {self.box_rows}x{self.cols}"


def _plane_shape(plan: PartPlan) -> tuple[int, int, int] | str:
    """(size, cols, box_rows) of the planes of `plan`'s reduced axes (see Planes), or why none."""
    if plan.p_contiguous or len(plan.L) < 2:
        return "planes need reduced axes (outer, *plane) around the parallel one"
    size = plan.L_total // plan.extents[plan.L[0]]
    cols = 1
    while size % (cols * 2) == 0 and cols * 2 <= 256:
        cols *= 2
    box_rows = pow2(size // cols)
    if cols * plan.big_elem_bytes < 16 or box_rows > 256:
        return f"a plane of {size} elements has no TMA box (rows of {cols} elements, {size // cols} of them)"
    return size, cols, box_rows


def plane_geometry(plan: PartPlan, cfg: Config) -> Planes | str:
    """The planes of a TMA-fed split over `plan` (see Planes), or why it has none."""
    shape = _plane_shape(plan)
    if isinstance(shape, str):
        return shape
    size, cols, box_rows = shape
    pieces = cfg.BL // (box_rows * cols)
    if cfg.BP != 1 or pieces * box_rows * cols != cfg.BL or pieces * cfg.split != plan.extents[plan.L[0]]:
        return (f"planes need BP=1, BL a whole number of {box_rows * cols}-slot planes and split x planes per "
                f"piece = {plan.extents[plan.L[0]]}, not {cfg}")
    return Planes(plan.L[0], tuple(plan.L[1:]), size, cols, box_rows, pieces)


def _coop_planes(plan: PartPlan, sms: int) -> list[Config]:
    """Persistent groups of TMA-fed plane pieces (batch norm's channels, codegen_tma): 8 planes per
    program at 8 warps (one per SM), or 4 at 4 warps (two per SM). On the H100, by hand
    (`scripts/batchnorm_planes_probe.py`): 168-169 µs against the register-held split's 186."""
    shape = _plane_shape(plan)
    if isinstance(shape, str):
        return []
    _, cols, box_rows = shape
    out = []
    for pieces, warps, per_sm in ((8, 8, 1), (4, 4, 2)):
        split, slots = plan.extents[plan.L[0]] // pieces, sms * per_sm
        cfg = Config(1, pieces * box_rows * cols, split, warps, persistent=slots // split * split, coop=True, tma=True)
        if (2 <= split <= slots // 2 and cfg.BL <= MAX_ROW_IN_REGISTERS and coop_refusal(plan, cfg) is None
                and not isinstance(plane_geometry(plan, cfg), str)):
            out.append(cfg)
    return out


def _warps(tile: int, elem_bytes: int) -> int:
    per_thread = 16 if elem_bytes <= 2 else 8  # two 16-byte vectors in flight per thread
    w = max(1, tile // (32 * per_thread))
    return min(16, pow2(w))


MAX_TILE = 1 << 20  # Triton's largest tensor (elements): a larger [BP, BL] tile does not compile


def _fix(plan: PartPlan, BP: int, BL: int, split: int = 1, warps: int | None = None) -> Config:
    BP = max(1, min(BP, pow2(plan.P_total)))
    BL = max(1, min(BL, pow2(plan.L_total), MAX_TILE // BP))
    split = max(1, min(split, cdiv(plan.L_total, BL)))
    return Config(BP, BL, split, warps or _warps(BP * BL, plan.big_elem_bytes))


def _elementwise(plan: PartPlan, sms: int) -> list[Config]:
    if plan.transposed:  # square-ish tiles: Triton transposes through shared memory
        out = []
        for BP, BL, w in ((64, 64, 4), (64, 128, 8), (128, 64, 8), (32, 128, 4)):
            out.append(_fix(plan, BP, BL, cdiv(plan.L_total, min(BL, pow2(plan.L_total))), w))
        return _unique(out)
    BL = min(pow2(plan.L_total), ELEMENTWISE_MAX_BL)
    split = cdiv(plan.L_total, BL)
    target = 8192 if plan.big_elem_bytes <= 2 else 4096
    BP = max(1, target // BL)
    return [_fix(plan, BP, BL, split), _fix(plan, BP * 2, BL, split), _fix(plan, max(1, BP // 2), BL, split)]


def _row_reduction(plan: PartPlan, sms: int) -> list[Config]:
    L, P = plan.L_total, plan.P_total
    out = []
    if L <= MAX_ROW_IN_REGISTERS:
        BL = pow2(L)
        for target in (4096, 8192, 2048):
            BP = max(1, target // BL)
            out.append(_fix(plan, BP, BL))
        out.append(_fix(plan, max(1, 4096 // BL), BL, warps=max(1, out[0].num_warps // 2)))
        if L > 8192:  # long rows: smaller chunks keep more rows (and their loads) in flight per SM
            chunked = [_fix(plan, 1, 4096, warps=8), _fix(plan, 1, 8192, warps=8), _fix(plan, 1, 2048, warps=4),
                       _fix(plan, 1, 4096, warps=4), _fix(plan, 1, 1024, warps=2)]
            out += chunked + [dataclasses.replace(c, prefetch=True) for c in chunked]
            if all(o in plan.row_level for o in plan.outputs):
                # Only per-row results (a loss): split rows into pieces that each fit one chunk,
                # so no program waits on its own chunk loop; the pieces' partial statistics meet
                # in a second, tiny launch.
                out += [_fix(plan, 1, 8192, cdiv(L, 8192), warps=8), _fix(plan, 1, 4096, cdiv(L, 4096), warps=4)]
    else:  # rows loop over chunks; a persistent grid keeps the rows in flight within L2
        for BL, grid in ((8192, sms), (8192, 0), (4096, 2 * sms), (16384, sms)):
            out.append(dataclasses.replace(_fix(plan, 1, BL), persistent=grid))
        out.append(dataclasses.replace(_fix(plan, 1, 8192, warps=8), persistent=2 * sms))
        out += [dataclasses.replace(c, prefetch=True) for c in out[:]]
        out += _coop(plan, sms)
    if cdiv(P, out[0].BP) < 2 * sms and L >= 8192:  # under two waves: split rows over programs
        for waves in (2, 4):
            out.append(_fix(plan, 1, min(pow2(L), 4096), cdiv(waves * sms, P)))
    return _unique(out)


def _column_reduction(plan: PartPlan, sms: int) -> list[Config]:
    """The contiguous axis is parallel: tiles wide along it for coalescing, the reduced axis
    split across programs so that the grid fills the device."""
    out = []
    wide = 128 if plan.big_elem_bytes <= 2 else 64
    for BP, tile, waves, warps in ((wide, 4096, 4, None), (wide, 16384, 2, 16), (wide * 2, 16384, 2, 16),
                                   (wide, 8192, 2, 8), (wide, 4096, 8, None)):
        BL = max(1, tile // BP)
        blocks = cdiv(plan.P_total, min(BP, pow2(plan.P_total)))
        split = cdiv(waves * sms, blocks)
        out.append(_fix(plan, BP, BL, split, warps))
    if plan.L_total >= 16384:  # long columns: read once, held in registers across the programs
        out += _coop(plan, sms)
    return _unique(out)


def _crossed_reduction(plan: PartPlan, sms: int) -> list[Config]:
    """Square tiles for a reduction whose large tensors disagree on the contiguous axis (a channel
    sum over an NCHW gradient computed from channels-last activations): each load and store keeps
    a run of 32-64 contiguous elements, where a row's tile strides through one side. Rows one per
    program took a U-Net's stem bias gradient 90 µs on an H100. None for small parts or agreeing layouts."""
    if not plan.crossed or plan.P_total < 32 or plan.L_total < 128:
        return []
    out = []
    for BP, BL, warps in ((64, 64, 4), (32, 128, 4), (64, 128, 8)):
        blocks = cdiv(plan.P_total, min(BP, pow2(plan.P_total)))
        out.append(_fix(plan, BP, BL, cdiv(4 * sms, blocks), warps))
    return _unique(out)


SECTOR_BYTES = 32  # a column tile narrower than a DRAM sector wastes the rest of each burst


def unsplit_config(plan: PartPlan, sms: int = 132) -> Config:
    """A reduction's config without a split of its local axes: a part packed with others shares one
    launch and no barrier. Rows stay whole per program (the chunk loop walks long ones); columns
    narrow their tile, down to a DRAM sector's width, until the blocks fill two waves. The wide
    tiles of `_column_reduction` left a U-Net's packed group-norm gradient sums ([2048 x 256],
    channels last) on 16 programs: 63-85 µs a launch on an H100."""
    if not plan.p_contiguous:
        return candidates(plan, sms, {"split": 1, "block_l": 1 << 15})[0]
    BP = 128 if plan.big_elem_bytes <= 2 else 64
    narrowest = max(1, SECTOR_BYTES // plan.big_elem_bytes)
    while BP > narrowest and cdiv(plan.P_total, BP) < 2 * sms:
        BP //= 2
    return _fix(plan, BP, max(1, 4096 // BP), 1)


def _unique(configs: list[Config]) -> list[Config]:
    seen, out = set(), []
    for c in configs:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def candidates(plan: PartPlan, sms: int = 132, override: dict | None = None) -> list[Config]:
    """Autotuning space for a part; `override` (from compile options) pins any of
    block_p / block_l / split / num_warps / persistent / prefetch / coop / tma / cp_async, which tests use to reach
    every code path."""
    if not plan.reductions:
        space = _elementwise(plan, sms)
    elif plan.p_contiguous:
        space = _column_reduction(plan, sms)
    else:
        space = _row_reduction(plan, sms) + _crossed_reduction(plan, sms)
    if override:
        base = space[0]
        BP = override.get("block_p", base.BP)
        BL = override.get("block_l", base.BL)
        split = override.get("split", base.split if "block_l" not in override else 1)
        if not plan.reductions and "split" not in override:
            split = cdiv(plan.L_total, max(1, min(BL, pow2(plan.L_total))))
        cfg = _fix(plan, BP, BL, split, override.get("num_warps"))
        coop = bool(override.get("coop", False)) and cfg.split > 1  # a row that fits one program has no one to meet
        if coop and override.get("tma") and "split" in override:  # pieces under the tile fill the SMs (_coop_tma)
            cfg = dataclasses.replace(cfg, split=override["split"])
        space = [dataclasses.replace(cfg, persistent=override.get("persistent", 0) if cfg.split == 1 or coop else 0,
                                     prefetch=bool(override.get("prefetch", False)),
                                     coop=coop, tma=coop and bool(override.get("tma", False)),
                                     cp_async=coop and bool(override.get("cp_async", False)))]
    return space
