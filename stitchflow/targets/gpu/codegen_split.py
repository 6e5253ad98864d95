"""Stitching through global memory when a part's rows are split across programs (codegen's
PartKernel mixes this in): partial reductions go to a buffer, then either the next launch
(PHASE) combines them, or, cooperatively, the programs of a row meet at an in-kernel barrier
and combine them while their pieces stay in registers.

Cooperative kernels: `program_coop` (a row block per program group, the default) and
`program_coop_persistent` (groups walk the row blocks, prefetching; an option, slower on the
H100). For column blocks, a centred variance meets at its mean's barrier (`centred_variances`).
The barrier itself is `row_barrier`."""

from __future__ import annotations

import re

from ...ir.expr import Call, Cast, Const, Read, reads
from .emit import Scope, Source, Val
from .mapping import pow2, split_len


class SplitStitching:
    """Needs from its host: src, arg, graph, plan, cfg, split, nodes, wide, need_mask_p, body,
    chunk_scope, and the stage methods (stage_loop, emit_ready_rows, store_rows, coord, chunk,
    _prefetch, _use_prefetched, _masked_body, _online_total, _reduce, _finish_reduction)."""

    def program_coop_persistent(self) -> None:
        """The cooperative split on a persistent grid: `persistent // split` groups of `split`
        programs walk the row blocks, and each program issues the loads of its piece of the next
        row block right after arriving at the current row's last barrier, so they are in flight
        while it waits, combines and stores (with few programs per SM, a barrier otherwise leaves
        DRAM idle). Not before the arrival: its release waits for the thread's loads in flight."""
        plan, cfg, e = self.plan, self.cfg, self.src.emit
        nblocks = -(-plan.P_total // cfg.BP)
        groups = min(nblocks, cfg.persistent // self.split)  # as mapping.programs launches
        e(f"pid_s = pid % {self.split}")
        e(f"grp = pid // {self.split}")
        e(f"lo = pid_s * {split_len(plan, cfg)}")
        e(f"hi = tl.minimum(lo + {split_len(plan, cfg)}, {plan.L_total})")
        loads = self._piece_loads()
        carried = self._first_prefetch(loads)
        e(f"for pid_p in range(grp, {nblocks}, {groups}):")
        self.src.depth += 1
        self._row_start("pid_p")
        current = [self.src.let(name, "cur") for name in carried]
        following: list[str] = []

        def prefetch_next():  # after the arrival: a release waits for this thread's loads in flight
            following.extend(self._row_prefetch(loads, f"pid_p + {groups}"))
            self._row_start("pid_p")
        root = Scope()
        for c in self.plan.P:
            self.coord(c, root)
        e("l0 = lo")
        self.chunk_scope = self.chunk(root)
        self._use_prefetched(self.chunk_scope, loads, current)
        self._coop_stages(root, prefetch_next)
        for name, code in zip(carried, following):
            e(f"{name} = {code}")
        self.src.depth -= 1

    def _first_prefetch(self, loads: list) -> list[str]:
        """The first row block's piece, before the loop. Its coordinates get names of their own:
        a name assigned both before and inside the loop would be carried around it, and the
        carried index and mask tiles made the kernel spill."""
        real, self.src = self.src, Source()
        self.src.count, self.src.depth = real.count, real.depth
        try:
            carried = self._row_prefetch(loads, "grp")
        finally:
            scratch, self.src = self.src, real
        real.count = scratch.count
        real.lines += [re.sub(r"\b(p|l|mask_p|mask_l)\b", r"\1_first", line) for line in scratch.lines]
        return carried

    def _row_start(self, block: str, force_mask: bool = False) -> None:
        """p (and mask_p) for row block `block`."""
        base = f"({block}).to(tl.int64)" if self.wide else f"({block})"
        self.src.emit(f"p = {base} * {self.cfg.BP} + tl.arange(0, {self.cfg.BP})[:, None]")
        if self.need_mask_p or force_mask:
            self.src.emit(f"mask_p = p < {self.plan.P_total}")

    def _row_prefetch(self, loads: list, block: str) -> list[str]:
        """Issue this program's piece loads for row block `block` (masked: it may lie past the
        last row) and return their raw values."""
        self._row_start(block, force_mask=True)
        saved, self.need_mask_p = self.need_mask_p, True
        root = Scope()
        for c in self.plan.P:
            self.coord(c, root)
        codes = self._prefetch(root, loads, "lo")
        self.need_mask_p = saved
        return codes

    def _piece_loads(self) -> list:
        """The loads of the first stage's reductions over a program's piece, found by emitting
        them once into scratch source that is then dropped."""
        real, self.src = self.src, Source()
        self.src.count, self.src.depth = real.count, real.depth
        self.body.log = []
        try:
            root = Scope()
            for c in self.plan.P:
                self.coord(c, root)
            self.src.emit("l0 = lo")
            self.chunk_scope = self.chunk(root)
            first = min(self.plan.stage[r.name] for r in self.plan.reductions)
            self.stage_loop(root, [r for r in self.plan.reductions if self.plan.stage[r.name] == first], [],
                            partial=True)
            found = {entry[0]: entry for entry in self.body.log if "l" in entry[4]}
        finally:
            self.body.log, self.src, self.chunk_scope = None, real, None
        return list(found.values())

    def program_coop(self) -> None:
        """All stages in one launch: each program reduces its piece of the row (kept in registers,
        one chunk), publishes the partials, waits at the row's barrier, and combines everyone's."""
        root = Scope()
        for c in self.plan.P:
            self.coord(c, root)
        self.chunk_scope = None
        self._coop_stages(root)

    def _coop_stages(self, root: Scope, while_waiting=None) -> None:
        """Every stage of one row block: reduce the piece, publish, wait, combine; then store.
        `while_waiting` emits work to issue after the last barrier's arrival, before its wait."""
        final = self.plan.final_stage
        self._load_parameters(root)
        self.emit_ready_rows(root, 0)
        barriers = 0
        # centred variances met at their mean's barrier: column blocks whose piece stays in registers only.
        # column_standardize went from 288 to 259 µs (H100). Batch norm's (N, H, W) rows took 3.4 ms instead of
        # 0.21: its 32768-element pieces made ptxas spill (32 registers, ~800 spill stores; per-axis index math,
        # since merged by emit._contiguous_runs). With the index math merged, 16384-element pieces still spill
        # with the rewrite (the piece and its centred copy both live: 255 registers and 68 spills at 8 warps),
        # and a device probe of it, which first compiled the spilling 32768-element variant, did not finish in
        # 120 s. A piece re-read chunk by chunk (a cooperative split over several chunks, options only) takes
        # its variance in a stage of its own.
        # Rows take it where a thread holds at most 16 elements of the piece, so that the piece and its centred
        # copy stay in registers: group norm's 65536-element groups as 8 pieces of 8192 at 16 warps (at 32 a
        # thread, with its per-channel weight and bias gathered, ptxas spilled 32 bytes).
        per_thread = self.cfg.BP * self.cfg.BL // (32 * self.cfg.num_warps)
        one_piece = self.single_chunk and (self.plan.p_contiguous or self.planes is not None or per_thread <= 16)
        variances = centred_variances(self.graph, self.plan) if one_piece else {}
        waits = [self.plan.stage[r.name] for r in self.plan.reductions if r.name not in variances]
        rounds = len({s for s in waits if s < final}) * self.split  # arrivals at a row's counter per launch
        for s in range(final + 1):
            if not self.single_chunk:  # pieces re-read after each barrier: keep them in L2 until the last read
                self.load_hint = "evict_first" if s == final else "evict_last"
            reds = [r for r in self.plan.reductions if self.plan.stage[r.name] == s and r.name not in variances]
            full_outs = [o for o in self.plan.outputs if o not in self.plan.row_level] if s == final else []
            own = self.stage_loop(root, reds, full_outs, partial=s < final) if reds or full_outs else {}
            if reds and s < final:
                riding = [(v, m, c) for v, (m, c) in variances.items() if self.plan.stage[m] == s]
                for var, mean, _ in riding:
                    self._piece_variance(var, mean, own[mean])
                barriers += 1
                self.row_barrier(barriers * self.split, rounds, while_waiting if s == max(waits) else None)
                self._issue_partial_loads(reds, riding)
                for r in reds:
                    self.combine_partials(r, root)
                for var, mean, scale in riding:
                    self._combine_variance(var, mean, scale, root)
                self._loaded = {}
            self.emit_ready_rows(root, s + 1)
        self.load_hint = None
        self.store_rows(root)

    def _load_parameters(self, root: Scope) -> None:
        """Loads that vary only with the parallel axes (batch norm's weight and bias), issued before
        the first barrier: emitted where the stage after a barrier first uses them, they waited
        behind its acquiring poll (a load may not move above it), one L2 round trip per row block
        (batch norm on the H100: 167.0 against 165.1 µs source-edited; generated, 166-168 before and
        164.6-165 after, near run-to-run noise). Later uses find them in `root`, and a second call
        (the TMA path issues them before its piece lands) emits nothing."""
        plan = self.plan
        for node in plan.nodes:
            for a in reads(node.body):
                if a.tensor in self.group_names or a.tensors != {a.tensor}:
                    continue
                if all(plan.cls.get((node.name, v)) in plan.P for v in a.vars):
                    self.body.load(a.tensor, a.indices, node, root)

    def _piece_variance(self, var: str, mean: str, local: str) -> None:
        """This piece's own centred sum of squares (the variance's body taken about the piece's
        mean, from registers), published as the variance's partial. `local`: the mean's
        reduction over this piece, as the stage computed it."""
        e, scope = self.src.emit, self.chunk_scope
        r_var = self.graph.node_of[var]
        if self.planes is not None:  # whole planes, each `pad` slots of which `size` hold elements
            count = str(self.planes.pieces * self.planes.size)
        else:
            count = self.src.let("tl.maximum(hi - lo, 1)", "n")
        own = self.src.let(f"{local} * ({self.plan.L_total} / {count})", "mu")  # the mean as if this piece were all
        sub = Scope(scope, chunk=True)
        sub.values[("node", mean)] = Val(own, "f", frozenset({"p"}))
        e(f"# {var}: about this piece's mean, corrected at the combine (Chan et al.)")
        self.store_partial(r_var, self.src.let(self._reduce(r_var, self._masked_body(r_var, sub)), "r"))

    def _combine_variance(self, var: str, mean: str, scale: float, root: Scope) -> None:
        """sum over all of c·(x - mean)² = sum over pieces of [c·(x - mean_s)² + c·n_s·(mean_s - mean)²].
        The spread of the pieces' means is taken about piece 0's mean K, known without waiting
        for the whole mean: sum n_s·(mean_s - K)² - n·(mean - K)². K lies as close to the mean as
        the pieces' means lie to each other, so the difference loses little, and the spread is a
        small part of the total. Taken about the mean itself, it was a second reduction waiting
        on the mean's: column_standardize 228 against 218 µs on the H100."""
        r_mean, r_var = self.graph.node_of[mean], self.graph.node_of[var]
        sums, squares = self._load_partials(r_mean), self._load_partials(r_var)
        n, piece = self.plan.L_total, split_len(self.plan, self.cfg)
        s = self.src.let(f"tl.arange(0, {pow2(self.split)})[None, :]", "s")
        count = self.src.let(f"tl.minimum({piece}, tl.maximum({n} - {s} * {piece}, 0)).to(tl.float32)", "n")
        shift = self.src.let(f"{self._load_partials(r_mean, row=0)} * ({n} / {min(piece, n)})", "k")
        own = self.src.let(f"tl.where({count} > 0, {sums} * ({n} / tl.maximum({count}, 1.0)), {shift})", "mu")
        about = self.src.let(f"tl.sum({squares} + {scale!r} * {count} * ({own} - {shift}) * ({own} - {shift}), "
                             f"axis=1, keep_dims=True)", "r")  # one reduction for both sums
        whole = root.get(("node", mean)).code
        total = self.src.let(f"tl.maximum({about} - {scale * n!r} * ({whole} - {shift}) * ({whole} - {shift}), 0.0)",
                             "r")
        self._finish_reduction(r_var, total, root)

    def row_barrier(self, target: int, rounds: int, while_waiting=None) -> None:
        """Wait until this launch's arrivals at the row's counter reach `target` (every program of
        the row arrived, once per barrier). The block barrier orders this program's partial
        stores before its arrival, which releases them; the acquiring reads make the others'
        visible. The programs of a row are adjacent in the grid, so all of them run at once
        whenever the GPU holds at least `split` programs.

        Counters are never reset: a launch adds `rounds` to each, and launches on one stream run
        one after another, so the first arrival's old count tells which launch this is (int64:
        no wrap). So no memset runs before each call (2 µs of a 214 µs column_center on the H100),
        and a CUDA-graph replay finds them as good as new."""
        e, cnt = self.src.emit, self.arg["cnt"]
        e("tl.debug_barrier()")
        e(f"arrived = tl.atomic_add({cnt} + pid_p, 1, sem='acq_rel', scope='gpu')")
        if target == self.split:  # the first barrier: this launch's base count
            e(f"launch_base = arrived // {rounds} * {rounds}")
        e("arrived += 1")
        if while_waiting is not None:
            while_waiting()
        e(f"while arrived < launch_base + {target}:")
        e(f"    arrived = tl.atomic_add({cnt} + pid_p, 0, sem='acquire', scope='gpu')")

    def _issue_partial_loads(self, reds, riding) -> None:
        """Every partial this barrier's combines read, loaded before any is used, so that the
        loads share one L2 round trip (a centred variance's combine loaded its mean's partials a
        second time, after the mean's combine had waited for its own: column_standardize by hand
        on the H100, 226.5 against 218.1 µs)."""
        online = self.plan.online or {}
        names = [r.name for r in reds] + [online[r.name] for r in reds if r.name in online]
        self._loaded = {}
        for name in dict.fromkeys(names + [var for var, _, _ in riding]):
            self._loaded[name, None] = self._load_partials(self.nodes[name])
        for _, mean, _ in riding:  # the shift of the spread of the pieces' means (_combine_variance)
            self._loaded[mean, 0] = self._load_partials(self.nodes[mean], row=0)

    def store_partial(self, r, value: str) -> None:
        mask = ", mask=mask_p" if self.need_mask_p else ""
        self.src.emit(f"tl.store({self.arg['buf:' + r.name]} + pid_s * {self.plan.P_total} + p, {value}{mask})")

    def _load_partials(self, r, row: int | None = None) -> str:
        """Every split's partial of reduction `r` ([BP, split]), or split `row`'s alone ([BP, 1])."""
        if (r.name, row) in self._loaded:
            return self._loaded[r.name, row]
        sp = pow2(self.split)
        s = self.src.let(f"tl.arange(0, {sp})[None, :]", "s") if row is None else str(row)
        masks = ([f"({s} < {self.split})"] if sp != self.split and row is None else []) + (
            ["mask_p"] if self.need_mask_p else [])
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


# ---------------------------------------------------------------- centred variances

def _bare(e):
    while isinstance(e, Cast):
        e = e.arg
    return e


def _scaled(e):
    """(inner, c) for c·inner or inner·c, else None."""
    e = _bare(e)
    if isinstance(e, Call) and e.op == "mul":
        a, b = (_bare(x) for x in e.args)
        if isinstance(b, Const):
            return a, float(b.value)
        if isinstance(a, Const):
            return b, float(a.value)
    return None


def _through(graph, e):
    """Follow reads of elementwise nodes to the expression they stand for."""
    e = _bare(e)
    while isinstance(e, Read) and e.access.tensor in graph.node_of and graph.node_of[e.access.tensor].reduce is None:
        e = _bare(graph.node_of[e.access.tensor].body)
    return e


def centred_variances(graph, plan) -> dict[str, tuple[str, float]]:
    """Reductions of the form sum c·(x - m)² whose m is this part's earlier reduction
    sum x/n (n the reduced extent): variance -> (its mean, c). A cooperative split meets them at
    their mean's barrier: each piece centres on its own mean and the combine adds the spread
    of the pieces' means (Chan, Golub, LeVeque), so the variance needs no barrier of its own."""
    found = {}
    stage, reductions = plan.stage, {r.name for r in plan.reductions}
    for r in plan.reductions:
        scaled = _scaled(r.body) if r.reduce == "sum" else None
        square = _through(graph, scaled[0]) if scaled else None
        if not (isinstance(square, Call) and square.op == "mul" and _bare(square.args[0]) == _bare(square.args[1])):
            continue
        centred = _through(graph, square.args[0])
        if not (isinstance(centred, Call) and centred.op == "sub" and isinstance(_bare(centred.args[1]), Read)):
            continue
        mean = _bare(centred.args[1]).access.tensor
        x = _bare(centred.args[0])
        if mean not in reductions or stage[mean] >= stage[r.name] or not isinstance(x, Read):
            continue
        of_mean = _scaled(graph.node_of[mean].body)
        if (of_mean and isinstance(of_mean[0], Read) and of_mean[0].access.tensor == x.access.tensor
                and abs(of_mean[1] * plan.L_total - 1) < 1e-6):
            found[r.name] = (mean, scaled[1])
    return found

