"""Stitching through global memory when a part's rows are split across programs (codegen's
PartKernel mixes this in): partial reductions go to a buffer, then either the next launch
(PHASE) combines them, or, cooperatively, the programs of a row meet at an in-kernel barrier
and combine them while their pieces stay in registers."""

from __future__ import annotations

from .emit import Scope
from .mapping import pow2


class SplitStitching:
    """Needs from its host: src, arg, plan, cfg, split, nodes, need_mask_p, and the stage
    methods (stage_loop, emit_ready_rows, store_rows, coord, _online_total, _reduce,
    _finish_reduction, _neutral)."""

    def program_coop(self) -> None:
        """All stages in one launch: each program reduces its piece of the row (kept in registers,
        one chunk), publishes the partials, waits at the row's barrier, and combines everyone's."""
        root = Scope()
        for c in self.plan.P:
            self.coord(c, root)
        self.chunk_scope = None
        final = self.plan.final_stage
        self.emit_ready_rows(root, 0)
        barriers = 0
        for s in range(final + 1):
            reds = [r for r in self.plan.reductions if self.plan.stage[r.name] == s]
            full_outs = [o for o in self.plan.outputs if o not in self.plan.row_level] if s == final else []
            if reds or full_outs:
                self.stage_loop(root, reds, full_outs, partial=s < final)
            if reds and s < final:
                barriers += 1
                self.row_barrier(barriers * self.split)
                for r in reds:
                    self.combine_partials(r, root)
            self.emit_ready_rows(root, s + 1)
        self.store_rows(root)

    def row_barrier(self, target: int) -> None:
        """Wait until the row's counter reaches `target` (every program of the row arrived, once
        per barrier). The block barrier orders this program's partial stores before its
        arrival, which releases them; the acquiring reads make the others' visible. The
        programs of a row are adjacent in the grid, so all of them run at once whenever the
        GPU holds at least `split` programs."""
        e, cnt = self.src.emit, self.arg["cnt"]
        e("tl.debug_barrier()")
        e(f"arrived = tl.atomic_add({cnt} + pid_p, 1, sem='acq_rel', scope='gpu') + 1")
        e(f"while arrived < {target}:")
        e(f"    arrived = tl.atomic_add({cnt} + pid_p, 0, sem='acquire', scope='gpu')")

    def store_partial(self, r, value: str) -> None:
        mask = ", mask=mask_p" if self.need_mask_p else ""
        self.src.emit(f"tl.store({self.arg['buf:' + r.name]} + pid_s * {self.plan.P_total} + p, {value}{mask})")

    def _load_partials(self, r) -> str:
        sp = pow2(self.split)
        s = self.src.let(f"tl.arange(0, {sp})[None, :]", "s")
        masks = ([f"({s} < {self.split})"] if sp != self.split else []) + (["mask_p"] if self.need_mask_p else [])
        mask = f", mask={' & '.join(masks)}, other={self._neutral(r)}" if masks else ""
        mask += ", cache_modifier='.cg'" if self.cfg.coop else ""  # written by other SMs in this launch: not from L1
        return self.src.let(f"tl.load({self.arg['buf:' + r.name]} + {s} * {self.plan.P_total} + p{mask})", "parts")

    def combine_partials(self, r, root: Scope) -> None:
        parts = self._load_partials(r)
        m1 = (self.plan.online or {}).get(r.name)
        if m1 is not None:  # each split's sum is relative to its own maximum
            value = self._online_total(self._load_partials(self.nodes[m1]), parts)
        else:
            value = self.src.let(self._reduce(r, parts), "r")
        self._finish_reduction(r, value, root)
