"""Cooperative splits whose next piece streams into shared memory while the current one waits
at its barrier: TMA boxes for column blocks, cp.async for any other address pattern (Hopper;
the kernel is translated to Gluon, gluon_dialect).

A cooperative program holds its piece (BP columns x `split_len` rows) in registers from the load
until the barrier releases it; with one such program per SM, the SM reads nothing while it waits,
and the whole GPU moves in waves of load, wait, store. Measured on the H100 (column_center,
65536x1024 fp32, `scripts/coop_timeline_probe.py`): 88% of SM time busy, a third of it waiting;
74% of copy bandwidth. Here a persistent grid of groups walks the column blocks, and each program
issues the TMA copies of its next piece into shared memory right after arriving at the last
barrier, so DRAM serves them during the wait, the combine and the stores (the registers hold the
current piece, shared memory the next): 85-86% of copy in the hand-written probe
(`scripts/column_tma_probe.py`).

Needs (else `GluonRefusal`, which the autotuner skips): one parallel and one reduced axis, the
pieces read from row-major [L, P] inputs at their own coordinates, no partial tiles, pieces of
one chunk, a persistent cooperative grid. Batch norm's channels (reduced axes around the parallel
one) take pieces of whole planes instead (`mapping.Planes`): one TMA box per plane, local points
numbered plane by plane (`plane_coord`): 186 -> 166 µs on the H100."""

from __future__ import annotations

import math

from ...ir.expr import Var
from .emit import Scope, Val, contiguous_strides
from .gluon_dialect import GluonRefusal
from .mapping import plane_geometry, split_len

TMA_BOX_ROWS = 256  # a TMA box spans at most 256 elements per dimension
TMA_SMEM_BYTES = 200 * 1024  # the pieces' buffers, leaving room for reductions' scratch in 227 KB
TMA_DTYPES = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2}


def tma_box(plan, cfg) -> tuple[int, int]:
    """Rows and columns of one TMA copy: a piece takes BL // rows of them (rows past the piece,
    read but masked, belong to the next piece or lie past the tensor, which TMA fills with zeros)."""
    return min(TMA_BOX_ROWS, cfg.BL), cfg.BP


class TmaStitching:
    """Mixed into PartKernel next to SplitStitching (whose stages and barrier it reuses)."""

    def _streamed_loads(self, how: str) -> list:
        """The piece loads of a streamed config (`how`: "TMA" or "cp.async"); raises GluonRefusal
        for what neither path can take."""
        cfg = self.cfg
        if self.interpret:
            raise GluonRefusal(f"{how} pieces need a Hopper GPU (the interpreter runs no Gluon)")
        if not (cfg.coop and cfg.persistent and self.single_chunk):
            raise GluonRefusal(f"{how} pieces need a persistent cooperative split whose pieces are one chunk")
        loads = self._piece_loads()
        for _, tensor, _, _, _ in loads:
            if tensor in self.group_names:
                raise GluonRefusal(f"{tensor} is computed in this kernel, not read from memory")
        return loads

    def tma_box_of(self, tensor: str) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """(box, view) of the descriptor of `tensor` (view: the shape the tensor is seen as)."""
        pl = self.planes
        if pl is None:
            return tma_box(self.plan, self.cfg), None
        n = self.plan.extents[pl.outer]
        return (1, pl.box_rows, pl.cols), (n * self.plan.P_total, pl.size // pl.cols, pl.cols)

    def tma_tensors(self) -> list[str]:
        """The inputs whose pieces arrive by TMA, in order; raises GluonRefusal when the part
        cannot take this path."""
        plan, cfg = self.plan, self.cfg
        loads = self._streamed_loads("TMA")
        if self.planes is not None:
            return self._plane_tensors(loads)
        if not plan.p_contiguous:
            raise GluonRefusal(f"TMA pieces: {plane_geometry(plan, cfg)}")
        if len(plan.P) != 1 or len(plan.L) != 1:
            raise GluonRefusal("TMA pieces need one contiguous parallel axis and one reduced axis")
        piece = split_len(plan, cfg)
        if self.need_mask_p or piece > cfg.BL or cfg.BL % tma_box(plan, cfg)[0]:
            raise GluonRefusal(f"TMA pieces need whole column tiles and pieces within the tile: {plan.P_total} "
                               f"columns by {cfg.BP}, pieces of {piece} rows in tiles of {cfg.BL}")
        tensors: list[str] = []
        for _, tensor, idx, node, _ in loads:
            why = self._tma_refusal(tensor, idx, node)
            if why:
                raise GluonRefusal(why)
            if tensor not in tensors:
                tensors.append(tensor)
        smem = sum(cfg.BL * cfg.BP * TMA_DTYPES[str(self.graph.type_of[t].dtype)] for t in tensors)
        if smem > TMA_SMEM_BYTES:
            raise GluonRefusal(f"TMA pieces need {smem} bytes of shared memory, over {TMA_SMEM_BYTES}")
        return tensors

    def _plane_tensors(self, loads: list) -> list[str]:
        """The inputs of plane pieces: each read at its own (outer, channel, *plane) coordinates
        from a contiguous tensor of exactly those dims."""
        plan, pl = self.plan, self.planes
        if self.wide:
            raise GluonRefusal("plane pieces number their points in 32 bits; these tensors need 64-bit offsets")
        channel = [c for c in plan.P if plan.extents[c] == plan.P_total]
        tensors: list[str] = []
        for _, tensor, idx, node, _ in loads:
            ty = self.graph.type_of[tensor]
            axes = [plan.cls.get((node.name, i.name)) if isinstance(i, Var) else None for i in idx]
            shape = tuple(plan.extents[a] for a in [pl.outer, *channel[:1], *pl.run])
            if (str(ty.dtype) not in TMA_DTYPES or axes != [pl.outer, *channel[:1], *pl.run]
                    or tuple(ty.shape) != shape or tuple(self.strides[tensor]) != contiguous_strides(shape)):
                raise GluonRefusal(f"{tensor} is not a contiguous {list(shape)} tensor read at its own "
                                   f"(outer, channel, plane) coordinates")
            if tensor not in tensors:
                tensors.append(tensor)
        smem = sum(self.cfg.BL * TMA_DTYPES[str(self.graph.type_of[t].dtype)] for t in tensors)
        if smem > TMA_SMEM_BYTES:
            raise GluonRefusal(f"TMA pieces need {smem} bytes of shared memory, over {TMA_SMEM_BYTES}")
        return tensors

    def plane_coord(self, outer, inner, scope: Scope) -> Val:
        """A reduced axis' coordinate under plane numbering (Planes): the plane is l // pad, and
        the axes within it decompose l % pad."""
        pl, plan = self.planes, self.plan
        if outer == pl.outer or inner == pl.outer:
            if outer != inner:
                raise GluonRefusal("plane pieces need every access laid out plane by plane (one here spans "
                                   "planes and the axes within them, as in a channels-last tensor)")
            return Val(self.src.let(f"(l // {pl.pad})", "c"), "i", frozenset({"l"}))
        within = scope.get(("coord", "plane"))
        if within is None:
            within = Val(self.src.let(f"(l % {pl.pad})", "c"), "i", frozenset({"l"}))
            scope.values[("coord", "plane")] = within
        a, b = pl.run.index(outer), pl.run.index(inner)
        below = math.prod(plan.extents[c] for c in pl.run[b + 1:])
        code = within.code if below == 1 else f"({within.code} // {below})"
        if a > 0:
            code = f"({code} % {math.prod(plan.extents[c] for c in pl.run[a:b + 1])})"
        return Val(self.src.let(code, "c"), "i", frozenset({"l"}))

    def _tma_refusal(self, tensor: str, idx, node) -> str | None:
        plan = self.plan
        ty = self.graph.type_of[tensor]
        if str(ty.dtype) not in TMA_DTYPES or self.cfg.BP * TMA_DTYPES[str(ty.dtype)] < 16:
            return f"{tensor}: TMA boxes need 16-byte rows of a float type, not {self.cfg.BP} x {ty.dtype}"
        if self.cfg.BP * TMA_DTYPES[str(ty.dtype)] > 128 and self.cfg.BL > TMA_BOX_ROWS:
            # Triton splits such a box into one copy per 128 bytes of its rows, and those copies into
            # a row slice of the piece's buffer landed wrong on the H100 (64 fp32 columns: 512-row
            # pieces wrong, 256-row pieces right; unswizzled boxes, one message per row slice, were wrong
            # the same way and slower, 324 against 213 µs for column_center), so a piece this wide must
            # be one box
            return (f"{tensor}: box rows of {self.cfg.BP} x {ty.dtype} span over 128 bytes, so a piece must be one "
                    f"box of at most {TMA_BOX_ROWS} rows, not {self.cfg.BL}")
        if tuple(ty.shape) != (plan.L_total, plan.P_total) or tuple(self.strides[tensor]) != (plan.P_total, 1):
            return f"{tensor} is not a row-major [{plan.L_total}, {plan.P_total}] tensor"
        axes = [plan.cls.get((node.name, i.name)) if isinstance(i, Var) else None for i in idx]
        if axes != [plan.L[0], plan.P[0]]:
            return f"{tensor} is not read at its own (row, column) coordinates"
        return None

    def cp_async_refusal(self) -> None:
        """Raises GluonRefusal when a part cannot take cp.async pieces (any address pattern, but
        4-byte elements: cp.async copies 4, 8 or 16 bytes)."""
        cfg = self.cfg
        loads = self._streamed_loads("cp.async")
        for _, tensor, _, _, _ in loads:
            if self.graph.type_of[tensor].dtype.itemsize != 4:
                raise GluonRefusal(f"cp.async pieces need 4-byte elements, {tensor} is "
                                   f"{self.graph.type_of[tensor].dtype}")
        if len(loads) * cfg.BP * cfg.BL * 4 > TMA_SMEM_BYTES:
            raise GluonRefusal(f"cp.async pieces need {len(loads) * cfg.BP * cfg.BL * 4} bytes of shared memory, "
                               f"over {TMA_SMEM_BYTES}")

    def program_coop_streamed(self) -> None:
        """The persistent cooperative program whose pieces stream into shared memory: the first
        piece's copies (TMA boxes completing on an mbarrier, or cp.async in a commit group), then
        per row block: wait for the piece, move it to registers, free the buffers, run the stages
        (SplitStitching._coop_stages), and after the last arrival start the next piece."""
        plan, cfg, e = self.plan, self.cfg, self.src.emit
        nblocks = -(-plan.P_total // cfg.BP)
        groups = min(nblocks, cfg.persistent // self.split)
        piece = split_len(plan, cfg)
        e(f"pid_s = pid % {self.split}")
        e(f"grp = pid // {self.split}")
        if self.planes is not None:  # whole planes, numbered with `pad` slots each
            e(f"lo = pid_s * {cfg.BL}")
            e(f"hi = lo + {cfg.BL}")
        else:
            e(f"lo = pid_s * {piece}")
            e(f"hi = tl.minimum(lo + {piece}, {plan.L_total})")
        loads = self._piece_loads()
        if cfg.tma:
            tensors = list(dict.fromkeys(t for _, t, _, _, _ in loads))
            smem = {t: f"smem{k}" for k, t in enumerate(tensors)}
            e("bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())")
            pl = self.planes
            shape = [cfg.BL, cfg.BP] if pl is None else [pl.pieces, pl.box_rows, pl.cols]
            for t in tensors:
                desc = self.arg["tma:" + t]
                e(f"{smem[t]} = gl.allocate_shared_memory({desc}.dtype, {shape}, {desc}.layout)")
            e("mbarrier.init(bar, count=1)")
            e("fence_async_shared()")
            view = ".permute((1, 0))" if pl is None else f".reshape([1, {cfg.BL}])"
            reads = [f"{smem[t]}{view}.load(LAYOUT)" for _, t, _, _, _ in loads]

            def fetch(block: str) -> None:
                self._tma_fetch(tensors, smem, block)
        else:
            order = "[0, 1]" if plan.p_contiguous else "[1, 0]"
            for k, (_, t, _, _, _) in enumerate(loads):
                dtype = "tl.float32" if self.graph.type_of[t].dtype.is_floating_point else "tl.int32"
                e(f"piece{k} = gl.allocate_shared_memory({dtype}, [{cfg.BP}, {cfg.BL}], "
                  f"gl.SwizzledSharedLayout(1, 1, 1, {order}))")
            reads = [f"piece{k}.load(LAYOUT)" for k in range(len(loads))]

            def fetch(block: str) -> None:
                self._cp_async_fetch(loads, block)
        fetch("grp")
        e("it = 0")
        e(f"for pid_p in range(grp, {nblocks}, {groups}):")
        self.src.depth += 1
        self._row_start("pid_p")
        root = Scope()
        for c in plan.P:
            self.coord(c, root)
        e("l0 = lo")
        self.chunk_scope = self.chunk(root)
        self._load_parameters(root)  # in flight while the piece lands
        if cfg.tma:
            e("mbarrier.wait(bar, it & 1)")
        else:
            e("async_copy.wait_group(0)")
            e("gl.thread_barrier()  # every thread's copies have landed")
        current = [self.src.let(code, "cur") for code in reads]
        e("gl.thread_barrier()  # every warp holds its share of the piece: the buffers may refill")
        if cfg.tma:
            e("fence_async_shared()")
        self._use_prefetched(self.chunk_scope, loads, current)

        def fetch_next():  # after the arrival: issued before it (right after the piece moved to registers),
            # the release waited for the copies and both column patterns fell back to the register split's times
            e(f"if pid_p + {groups} < {nblocks}:")
            self.src.depth += 1
            fetch(f"pid_p + {groups}")
            self.src.depth -= 1
        self._coop_stages(root, fetch_next)
        e("it += 1")
        self.src.depth -= 1
        if cfg.tma:
            e("mbarrier.invalidate(bar)")

    def _cp_async_fetch(self, loads: list, block: str) -> None:
        """cp.async copies of this program's piece of row block `block` into the piece buffers, as
        one commit group, at the loads' own addresses (masks included); `p` is set back to the
        current block afterwards."""
        e = self.src.emit

        def copy(k: int, load, scope: Scope) -> None:
            _, tensor, idx, node, _ = load
            pointer, mask, _ = self.body.raw_address(tensor, idx, node, scope)
            e(f"async_copy.async_copy_global_to_shared(piece{k}, {pointer}{', mask=' + mask if mask else ''})")
        self._row_start(block)
        root = Scope()
        for c in self.plan.P:
            self.coord(c, root)
        self._prefetch(root, loads, "lo", issue=copy)
        e("async_copy.commit_group()")
        if block != "grp":
            self._row_start("pid_p")

    def _tma_fetch(self, tensors: list[str], smem: dict, block: str) -> None:
        """TMA copies of this program's piece of column block `block`, completing on `bar`."""
        if self.planes is not None:
            self._plane_fetch(tensors, smem, block)
            return
        e, (rows, cols) = self.src.emit, tma_box(self.plan, self.cfg)
        nbytes = sum(self.cfg.BL * cols * TMA_DTYPES[str(self.graph.type_of[t].dtype)] for t in tensors)
        e(f"mbarrier.expect(bar, {nbytes})")  # zero-filled rows past the tensor count too
        for t in tensors:
            for r0 in range(0, self.cfg.BL, rows):
                e(f"tma.async_copy_global_to_shared({self.arg['tma:' + t]}, [lo + {r0}, ({block}) * {cols}], bar, "
                  f"{smem[t]}.slice({r0}, {rows}))")

    def _plane_fetch(self, tensors: list[str], smem: dict, block: str) -> None:
        """One TMA box per plane of this program's piece of channel `block` (rows past the plane
        arrive as zeros and count towards the expected bytes)."""
        e, pl = self.src.emit, self.planes
        nbytes = sum(self.cfg.BL * TMA_DTYPES[str(self.graph.type_of[t].dtype)] for t in tensors)
        e(f"mbarrier.expect(bar, {nbytes})")
        for t in tensors:
            for i in range(pl.pieces):
                e(f"tma.async_copy_global_to_shared({self.arg['tma:' + t]}, [(lo // {pl.pad} + {i}) * "
                  f"{self.plan.P_total} + ({block}), 0, 0], bar, {smem[t]}.slice({i}, 1))")
