"""Generate one Triton kernel (Python source) for a group of nodes.

Each part (connected loop nest, analysis.PartPlan) becomes a `@triton.jit` function over a
[BP parallel] x [BL local] tile. Stitching schemes, per intermediate:
- registers: a node in the same iteration space is an expression over the same tile;
- reduce-then-broadcast inside one program: a reduction over the local axes becomes a
  [BP, 1] value that later stages broadcast (layernorm, softmax); when the local extent fits
  one chunk, the loaded row stays in registers across stages, else each stage loops over
  chunks and recomputes its inputs (re-reads hit L2);
- global memory with a barrier: when the local axes are split across programs, each stage
  writes partial reductions to a global buffer and the next launch (PHASE) combines them; or,
  cooperatively (`Config.coop`, GPU only), the programs of a row keep their pieces in registers
  and wait for each other at an in-kernel barrier on a per-row counter, so the row is read once;
  for column blocks on Hopper, a persistent grid streams each program's next piece into shared
  memory by TMA while the current one waits (codegen_tma; the module is translated to Gluon);
- packing: independent parts share one launch, dispatched on the program id.
"""

from __future__ import annotations

import math
import re

from dataclasses import dataclass

import torch

from ...ir.graph import Graph
from ...ir.interpret import scatter_identity
from .analysis import PartPlan
from .codegen_split import SplitStitching
from .codegen_tma import TmaStitching
from .codegen_welford import WelfordStitching, phase_stages, phased_riding
from .emit import (LOW_PRECISION, BodyEmitter, Scope, Source, Val, is_literal, carried, contiguous_strides, kind_of,
                   spread_address, to_dtype)
from .codegen_header import header
from .gluon_dialect import GluonRefusal, blocked_layout, to_gluon
from .scatter_stores import ScatterStitching, part_nodes, stored
from .mapping import Config, Planes, n_chunks, plane_geometry, programs, split_len

@dataclass(frozen=True)
class KernelSpec:
    source: str
    name: str
    inputs: tuple[str, ...]  # external tensors read (env names), in argument order
    outputs: tuple[str, ...]  # node outputs written
    buffers: tuple[tuple[str, int, torch.dtype], ...]  # partial-reduction scratch (name, numel, dtype)
    grid: int
    phases: int
    num_warps: int
    coop_group: int = 0  # programs of a cooperative split that must all be resident at once (0: none)
    # (input, TMA box, view or None) appended as descriptors: a Gluon kernel
    tma: tuple[tuple[str, tuple[int, ...], tuple[int, ...] | None], ...] = ()
    gluon: bool = False  # the source is Gluon (TMA or cp.async pieces: codegen_tma)
    # a persistent cooperative grid: launched with CUDA's cooperative attribute, so the driver runs
    # every program at once or refuses the launch
    cooperative: bool = False
    # outputs that scatters combine into atomically, with the value they start at (scatter_stores)
    fills: tuple[tuple[str, float | int], ...] = ()


def _ident(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)


class PartKernel(SplitStitching, TmaStitching, WelfordStitching, ScatterStitching):
    """Builds the body of one part's @triton.jit function."""

    def __init__(self, graph: Graph, plan: PartPlan, cfg: Config, arg: dict, strides: dict, src: Source,
                 interpret: bool, wide: bool, group_names: set):
        self.graph, self.plan, self.cfg, self.arg, self.strides, self.src = graph, plan, cfg, arg, strides, src
        self.node_names = {n.name for n in plan.nodes}
        self.group_names = group_names
        self.nodes = {n.name: n for n in plan.nodes}
        self.body = BodyEmitter(self, interpret)
        self.interpret = interpret
        self.wide = wide
        self.split = cfg.split
        self.single_chunk = n_chunks(plan, cfg) == 1
        self.need_mask_p = plan.P_total % cfg.BP != 0
        self.need_mask_l = plan.L_total % cfg.BL != 0 or split_len(plan, cfg) % cfg.BL != 0  # TMA pieces
        self.phased_riding = phased_riding(graph, plan, cfg)  # variances riding their mean's launch
        self.phase_stages = phase_stages(graph, plan, cfg, self.phased_riding)  # the stage each launch runs
        self.reduction_phases = len(self.phase_stages) > 1
        self.load_hint: str | None = None  # eviction policy of loads along the local axes (emit.raw_load)
        self._loaded: dict = {}  # partials loaded after a barrier, by reduction (codegen_split)
        geometry = plane_geometry(plan, cfg) if cfg.tma and not plan.p_contiguous else None
        self.planes = geometry if isinstance(geometry, Planes) else None  # codegen_tma: pieces of whole planes
        self._canon: dict = {}
        self._riding: dict = {}  # variances folded into their mean's chunk loop (codegen_welford)

    # ------------------------------------------------------------ coordinates and masks
    def canonical_names(self, node) -> dict:
        if node.name not in self._canon:
            self._canon[node.name] = {v: f"_c{self.plan.cls[(node.name, v)]}" for v, _ in node.dims}
        return self._canon[node.name]

    def coord(self, c, scope: Scope) -> Val:
        return self.coord_run(c, c, scope)

    def coord_run(self, outer, inner, scope: Scope) -> Val:
        """The coordinate of tile axis class `outer`, or one over the adjacent classes outer..inner
        (outer varying slowest) as if they were one axis: (flat // extent below inner) % their
        extents' product, the modulo dropped for the outermost class."""
        found = scope.get(("coord", outer, inner))
        if found is not None:
            return found
        if self.planes is not None and outer in self.plan.L:
            scope.values[("coord", outer, inner)] = val = self.plane_coord(outer, inner, scope)
            return val
        axes, flat, dep = (self.plan.P, "p", "p") if outer in self.plan.P else (self.plan.L, "l", "l")
        a, b = axes.index(outer), axes.index(inner)
        below = math.prod(self.plan.extents[other] for other in axes[b + 1:])
        code = flat if below == 1 else f"({flat} // {below})"
        if a > 0:
            code = f"({code} % {math.prod(self.plan.extents[c] for c in axes[a:b + 1])})"
        val = Val(self.src.let(code, "c"), "i", frozenset({dep}))
        scope.values[("coord", outer, inner)] = val
        return val

    def mask(self, deps, scope: Scope) -> str | None:
        use_p = "p" in deps and self.need_mask_p
        use_l = "l" in deps and self.need_mask_l
        if use_p and use_l:
            found = scope.get(("mask", "pl"))
            if found is None:
                found = self.src.let("mask_p & mask_l", "m")
                scope.values[("mask", "pl")] = found
            return found
        return "mask_p" if use_p else "mask_l" if use_l else None

    # ------------------------------------------------------------ node values
    def node_value(self, name: str, scope: Scope) -> Val:
        found = scope.get(("node", name))
        if found is not None:
            return found
        if name in self.plan.row_level:
            raise AssertionError(f"row-level value {name} used before it was computed")
        if not scope.chunk:
            raise AssertionError(f"full-space value {name} requested outside a chunk")
        return self._compute(name, scope)

    def _compute(self, name: str, scope: Scope) -> Val:
        node = self.nodes[name]
        v = self.body.expr(node.body, node, scope)
        dtype = self.graph.type_of[name].dtype
        if is_literal(v):  # torch.ones(...): a number, rounded to the dtype now (it has no .to())
            scope.values[("node", name)] = out = self.body.cast(v, dtype)
            return out
        out = Val(self.src.let(carried(v.code, dtype, self.interpret) if dtype != torch.bool or v.kind == "b" else f"({v.code} != 0)",
                               "v"), "b" if dtype == torch.bool else ("f" if dtype.is_floating_point else "i"), v.deps)
        scope.values[("node", name)] = out
        return out

    def store(self, name: str, value: Val, scope: Scope) -> None:
        node = self.nodes[name]
        for value_name, scatter in self.plan.scatters:
            if value_name == name:
                self.store_scattered(scatter, value, scope)
        if name in self.plan.scatter_only:
            return
        off = self.body.offset(name, node.index, node, scope)
        dtype = self.graph.type_of[name].dtype
        code = value.code if dtype == torch.bool or is_literal(value) else to_dtype(value.code, dtype, self.interpret)
        off = spread_address(off, value)
        mask = self.mask(off.deps, scope)
        self.src.emit(f"tl.store({self.arg[name]} + {off.code}, {code}{', mask=' + mask if mask else ''})")

    # ------------------------------------------------------------ program structure
    def emit(self) -> None:
        if self.cfg.tma or self.cfg.cp_async:
            self.program_coop_streamed()
            return
        if self.cfg.coop and self.cfg.persistent:
            self.program_coop_persistent()
            return
        if self.cfg.coop:
            self.prologue(0)
            self.program_coop()
            return
        n_phases = len(self.phase_stages)
        if n_phases == 1 and self.cfg.persistent and self.split == 1:
            nblocks = -(-self.plan.P_total // self.cfg.BP)
            self.src.emit(f"for pid_p in range(pid, {nblocks}, {programs(self.plan, self.cfg)}):")
            self.src.depth += 1
            self.prologue(0, persistent=True)
            self.program(None)
            self.src.depth -= 1
            return
        if n_phases == 1:
            self.prologue(0)
            self.program(None)
            return
        for k in range(n_phases):
            self.src.emit(f"{'if' if k == 0 else 'elif'} PHASE == {k}:")
            self.src.depth += 1
            self.prologue(k)
            self.program(k)
            self.src.depth -= 1

    def prologue(self, phase: int, persistent: bool = False) -> None:
        """Program id -> (parallel block, split). Odd phases walk the splits backwards, so the
        first programs of a phase re-read what the last programs of the previous one left in L2."""
        plan, cfg = self.plan, self.cfg
        nblocks = -(-plan.P_total // cfg.BP)
        e = self.src.emit
        split = f"{self.split - 1} - " if phase % 2 else ""
        if self.split == 1:
            if not persistent:
                e("pid_p = pid")
        elif plan.p_contiguous and not cfg.coop:
            e(f"pid_p = pid % {nblocks}")
            e(f"pid_s = {split}pid // {nblocks}")
        else:
            e(f"pid_s = {split}pid % {self.split}")
            e(f"pid_p = pid // {self.split}")
        base = "pid_p.to(tl.int64)" if self.wide else "pid_p"
        e(f"p = {base} * {cfg.BP} + tl.arange(0, {cfg.BP})[:, None]")
        if self.need_mask_p:
            e(f"mask_p = p < {plan.P_total}")
        if self.split == 1:
            e("lo = 0")
            e(f"hi = {plan.L_total}")
        else:
            e(f"lo = pid_s * {split_len(plan, cfg)}")
            e(f"hi = tl.minimum(lo + {split_len(plan, cfg)}, {plan.L_total})")

    def program(self, phase: int | None) -> None:
        root = Scope()
        for c in self.plan.P:
            self.coord(c, root)
        self.chunk_scope = None
        final = self.plan.final_stage
        self._riding = riding = self.riding_variances() if phase is None else self.phased_riding
        stage_of = {r.name: self.plan.stage[riding[r.name][0]] if r.name in riding else self.plan.stage[r.name]
                    for r in self.plan.reductions}
        if phase is None:
            stages = list(range(final + 1))
        else:
            stages = [self.phase_stages[phase]]
            for r in self.plan.reductions:  # what earlier launches left, a riding variance after its mean
                if stage_of[r.name] < stages[0] and r.name not in riding:
                    self.combine_partials(r, root)
            for var, (mean, factor) in riding.items():
                if stage_of[var] < stages[0]:
                    self._combine_variance(var, mean, factor, root)
        self.emit_ready_rows(root, stages[0])
        for s in stages:
            reds = [r for r in self.plan.reductions if stage_of[r.name] == s]
            full_outs = [o for o in self.plan.outputs if o not in self.plan.row_level] if s == final else []
            if reds or full_outs:
                self.stage_loop(root, reds, full_outs, partial=phase is not None and s < final)
            if phase is None or s == final:
                self.emit_ready_rows(root, s + 1)
        if stages[-1] == final:
            self.store_rows(root)

    def emit_ready_rows(self, root: Scope, upto: int) -> None:
        for n in self.plan.nodes:
            if n.name in self.plan.row_level and not n.reduce and self.plan.stage[n.name] <= upto:
                if root.get(("node", n.name)) is None:
                    self._compute(n.name, root)

    def store_rows(self, root: Scope) -> None:
        rows = [o for o in self.plan.outputs if o in self.plan.row_level]
        if not rows:
            return
        guarded = self.split > 1
        if guarded:
            self.src.emit("if pid_s == 0:")
            self.src.depth += 1
        for name in rows:
            self.store(name, self.node_value(name, root), root)
        if guarded:
            self.src.depth -= 1

    def chunk(self, root: Scope) -> Scope:
        """Open a chunk of BL local points starting at `l0` (the caller emitted l0)."""
        scope = Scope(root, chunk=True)
        self.src.emit(f"l = l0 + tl.arange(0, {self.cfg.BL})[None, :]")
        if self.planes is not None:  # the slots past each plane
            self.src.emit(f"mask_l = l % {self.planes.pad} < {self.planes.size}")
        elif self.need_mask_l:
            self.src.emit("mask_l = l < hi")
        return scope

    def stage_loop(self, root: Scope, reds, full_outs, partial: bool) -> dict:
        """Emit one stage; returns each reduction's value over this program's rows (a split's own part)."""
        e = self.src.emit
        online = self.plan.online or {}
        looped = not self.single_chunk
        results, local = {}, {}
        if looped:
            pairs = {v: mc for v, mc in self._riding.items() if v in {r.name for r in reds}}
            welford = {m: self.welford_init() for m, _ in pairs.values()}
            reds_all, reds = reds, [r for r in reds if r.name not in pairs and r.name not in welford]
            accs = {r.name: self._acc_init(r) for r in reds}
            loads = self._chunk_loads(root, reds, full_outs, accs, online, welford) if self.cfg.prefetch else []
            carried = self._prefetch(root, loads, "lo") if loads else []
            loops = self._chunk_loops()
            for k, (head, masked) in enumerate(loops):
                e(head)
                self.src.depth += 1
                current = [self.src.let(name, "cur") for name in carried]
                if carried and k == 0:  # the next chunk's loads go out before this chunk's math
                    for name, code in zip(carried, self._prefetch(root, loads, f"l0 + {self.cfg.BL}")):
                        e(f"{name} = {code}")
                saved, self.need_mask_l = self.need_mask_l, masked
                scope = self.chunk(root)
                self._use_prefetched(scope, loads, current)
                for m, acc in welford.items():
                    self.welford_step(m, acc, scope)
                self._accumulate(reds, full_outs, accs, scope, online)
                self.need_mask_l = saved
                self.src.depth -= 1
            for r in reds:
                if r.name in online:
                    results[r.name] = self._online_total(accs[online[r.name]], accs[r.name])
                else:
                    results[r.name] = self.src.let(self._reduce(r, accs[r.name]), "r")
            tail = str(self.plan.L_total % self.cfg.BL) if self.plan.L_total % self.cfg.BL else None
            for v, (m, factor) in pairs.items():
                results[m], results[v] = self.welford_piece(m, factor, welford[m]) if partial else \
                    self.welford_total(m, factor, welford[m], tail)
            reds = reds_all
        else:
            if self.chunk_scope is not None and not self.reduction_phases:
                scope = self.chunk_scope  # the row is still in registers from an earlier stage
            else:
                e("l0 = lo")
                scope = self.chunk_scope = self.chunk(root)
            for r in reds:  # one chunk: reduce now, so a later reduction of this stage can use the value
                sub = self._bind(scope, online.get(r.name), local)
                results[r.name] = self.src.let(self._reduce(r, self._masked_body(r, sub)), "r")
                local[r.name] = results[r.name]
                if not partial:
                    self._finish_reduction(r, results[r.name], root)
            for name in full_outs:
                self.store(name, self.node_value(name, scope), scope)
        for r in reds:
            if partial:
                self.store_partial(r, results[r.name])
            elif looped:
                self._finish_reduction(r, results[r.name], root)
        return results

    def _chunk_loops(self) -> list[tuple[str, bool]]:
        """(loop header, masked) per chunk loop. When the local extent is no multiple of the
        chunk, the full chunks run without the range test and the select it costs on every
        element, and the last, partial chunk runs once, masked."""
        BL = self.cfg.BL
        if not self.need_mask_l:
            return [(f"for l0 in range(lo, hi, {BL}):", False)]
        full = f"{self.plan.L_total // BL * BL}" if self.split == 1 else f"(lo + (hi - lo) // {BL} * {BL})"
        return [(f"for l0 in range(lo, {full}, {BL}):", False),
                (f"for l0 in range({full}, hi, {BL}):", True)]  # at most one iteration

    def _chunk_loads(self, root: Scope, reds, full_outs, accs: dict, online: dict, welford: dict) -> list:
        """The loads one chunk of this stage performs that move with the chunk, found by
        emitting the chunk once into scratch source that is then dropped."""
        real, self.src = self.src, Source()
        self.src.count, self.src.depth = real.count, real.depth
        self.body.log = []
        try:
            self.src.emit("l0 = lo")
            scope = self.chunk(root)
            for m, acc in welford.items():
                self.welford_step(m, acc, scope)
            self._accumulate(reds, full_outs, accs, scope, online)
            found = {entry[0]: entry for entry in self.body.log if "l" in entry[4]}
        finally:
            self.body.log, self.src = None, real
        return list(found.values())

    def _prefetch(self, root: Scope, loads: list, start: str, issue=None) -> list[str]:
        """Issue `loads` for the chunk at `start` (masked: it may lie past the end) and return
        their raw values, bound to fresh names the first time (the loop-carried registers).
        `issue(k, load, scope)`, when given, emits each load its own way instead (codegen_tma's
        cp.async copies) and returns nothing."""
        saved, self.need_mask_l = self.need_mask_l, True
        scope = Scope(root, chunk=True)
        self.src.emit(f"l = {start} + tl.arange(0, {self.cfg.BL})[None, :]")
        self.src.emit("mask_l = l < hi")
        if issue is not None:
            for k, load in enumerate(loads):
                issue(k, load, scope)
            codes = []
        else:
            codes = [self.src.let(self.body.raw_load(t, idx, node, scope)[0], "pf") for _, t, idx, node, _ in loads]
        self.need_mask_l = saved
        return codes

    def _use_prefetched(self, scope: Scope, loads: list, current: list[str]) -> None:
        for (key, tensor, _, _, deps), name in zip(loads, current):
            dtype = self.graph.type_of[tensor].dtype
            code = f"{name}.to(tl.float32)" if dtype in LOW_PRECISION else name
            scope.values[key] = Val(self.src.let(code, "x"), kind_of(dtype), deps)

    def _accumulate(self, reds, full_outs, accs: dict, scope: Scope, online: dict) -> None:
        """One chunk of a looped stage: advance every reduction's accumulator, store outputs."""
        e = self.src.emit
        for r in reds:
            if r.name in online:
                self._online_step(r, accs[online[r.name]], accs[r.name], scope)
            elif r.name in online.values():
                continue  # the online step of its sum advances this maximum
            else:
                acc, masked = accs[r.name], self._masked_body(r, scope)
                e(f"{acc} = _max_nan({acc}, {masked})" if r.reduce == "max" else f"{acc} = {acc} + {masked}")
        for name in full_outs:
            self.store(name, self.node_value(name, scope), scope)

    def _bind(self, scope: Scope, max_name: str | None, local: dict) -> Scope:
        """A scope where the max an online sum rescales by is this chunk's (or split's) own."""
        if max_name is None or max_name not in local:
            return scope
        sub = Scope(scope, chunk=True)
        # a piece (of a split row) that is all -inf sums exp(x - 0) = 0, not exp(-inf - -inf) = NaN, which the
        # combine's rescaling by 0 would not take back; a whole row of -inf is NaN downstream either way, as in torch
        shift = self.src.let(f"tl.where({local[max_name]} == NEG_INF, 0.0, {local[max_name]})", "m")
        sub.values[("node", max_name)] = Val(shift, "f", frozenset({"p"}))
        return sub

    def _online_step(self, r, acc_m: str, acc_s: str, scope: Scope) -> None:
        """One chunk of an online sum: m' = max(m, max of the chunk) per row; every lane's sum
        s' = s * exp(m - m') + exp(a - m'). The maximum is the row's, not the lane's, so each
        element costs one exponential (a lane-wise maximum needs two, and two exponentials per
        bf16 element are as many as the special-function units issue at copy bandwidth). While
        a row has seen only -inf the terms are taken against 0 instead, so that exp(-inf - -inf)
        never turns the sum into NaN."""
        m1 = self.plan.online[r.name]
        x = self._masked_body(self.nodes[m1], scope)
        m_new = self.src.let(f"tl.maximum({acc_m}, tl.max({x}, axis=1, keep_dims=True))", "m")
        m_ref = self.src.let(f"tl.where({m_new} == NEG_INF, 0.0, {m_new})", "m")
        sub = Scope(scope, chunk=True)
        sub.values[("node", m1)] = Val(m_ref, "f", frozenset({"p"}))
        term = self._masked_body(r, sub)
        alpha = self.src.let(f"tl.where({m_new} == NEG_INF, 0.0, tl.exp({acc_m} - {m_new}))", "a")
        self.src.emit(f"{acc_s} = {acc_s} * {alpha} + {term}")
        self.src.emit(f"{acc_m} = {m_new}")

    def _online_total(self, acc_m: str, acc_s: str) -> str:
        """Sum of the lanes' sums, each rescaled to the row maximum (the max's own reduction
        is emitted separately from the same accumulator)."""
        top = self.src.let(f"tl.max({acc_m}, axis=1, keep_dims=True)", "r")
        scale = self.src.let(f"tl.where({acc_m} == NEG_INF, 0.0, tl.exp({acc_m} - {top}))", "a")
        return self.src.let(f"tl.sum({acc_s} * {scale}, axis=1, keep_dims=True)", "r")

    def _acc_dtype(self, r) -> str:
        return _accumulator(self.graph.type_of[r.name].dtype)

    def _neutral(self, r) -> str:
        if _accumulator(self.graph.type_of[r.name].dtype) == "tl.int64":  # (int64's least but one: a literal)
            return "-9223372036854775807" if r.reduce == "max" else "0"
        return "NEG_INF" if r.reduce == "max" else "0.0"

    def _acc_init(self, r) -> str:
        rowwise = r.name in (self.plan.online or {}).values()  # an online sum's running maximum
        shape = f"[{self.cfg.BP}, {1 if rowwise else self.cfg.BL}]"
        return self.src.let(f"tl.full({shape}, {self._neutral(r)}, {self._acc_dtype(r)})", "acc")

    def _masked_body(self, r, scope: Scope) -> str:
        self.body.summing = r.reduce == "sum"
        try:
            v = self.body.expr(r.body, r, scope)
        finally:
            self.body.summing = False
        code = f"{v.code}.to({self._acc_dtype(r)})"
        if v.deps != frozenset({"p", "l"}):
            code = f"tl.broadcast_to({code}, [{self.cfg.BP}, {self.cfg.BL}])"
        if self.need_mask_l:
            code = f"tl.where(mask_l, {code}, {self._neutral(r)})"
        return self.src.let(code, "b")

    def _reduce(self, r, tile: str) -> str:
        if r.reduce == "max":  # a NaN is the maximum, as in torch (tl.max drops it)
            return f"tl.reduce({tile}, 1, _max_nan, keep_dims=True)"
        return f"tl.sum({tile}, axis=1, keep_dims=True)"

    def _finish_reduction(self, r, value: str, root: Scope) -> None:
        dtype = self.graph.type_of[r.name].dtype
        kind = "f" if dtype == torch.bool else kind_of(dtype)  # (a boolean's any/all stays its float 0 or 1)
        root.values[("node", r.name)] = Val(self.src.let(carried(value, dtype, self.interpret), "v"), kind, frozenset({"p"}))



def _accumulator(dtype: torch.dtype) -> str:
    """What a reduction into `dtype` accumulates in: float64 kept, integers in int64 (float32 rounded
    int32 sums and maxima past 2**24, and an argmax then found no element equal to its rounded peak),
    float32 otherwise."""
    if dtype == torch.float64:
        return "tl.float64"
    if not dtype.is_floating_point and dtype != torch.bool:
        return "tl.int64"
    return "tl.float32"


def build_kernel(graph: Graph, parts: list[tuple[PartPlan, Config]], strides: dict, interpret: bool,
                 title: str, group_names: set | None = None) -> KernelSpec:
    """One kernel for all parts of a group; `strides` gives the strides of external inputs;
    `group_names` names every node of the group (producers that parts inline)."""
    group_names = group_names or {n.name for plan, _ in parts for n in plan.nodes}
    parts = [(plan, cfg) for plan, cfg in parts if plan.outputs]  # a part only inlined elsewhere has no work
    inputs, outputs = _io(graph, parts, group_names)
    arg: dict = {}
    params: list[str] = []
    for k, t in enumerate(inputs):
        arg[t] = f"in{k}"
    for k, t in enumerate(outputs):
        arg[t] = f"out{k}"
        strides = {**strides, t: contiguous_strides(graph.type_of[t].shape)}
    buffers = []  # (name, elements, dtype): partial reductions; int64 ones are counters (runtime.Launch)
    for plan, cfg in parts:
        if len(phase_stages(graph, plan, cfg)) > 1 or cfg.coop:
            for r in plan.reductions:
                if plan.stage[r.name] < plan.final_stage:
                    arg["buf:" + r.name] = f"buf{len(buffers)}"
                    dt = {"tl.float64": torch.float64, "tl.int64": torch.int64}.get(
                        _accumulator(graph.type_of[r.name].dtype), torch.float32)
                    buffers.append((r.name, cfg.split * plan.P_total, dt))
        if cfg.coop:
            arg["cnt"] = arg["buf:rows_arrived"] = f"buf{len(buffers)}_rows_arrived"
            buffers.append(("rows_arrived", -(-plan.P_total // cfg.BP), torch.int64))
    wide = _needs_int64(graph, inputs + outputs, strides)
    tma = _streamed_inputs(graph, parts, arg, strides, interpret, wide, group_names)
    params = [arg[t] for t in inputs] + [arg[t] for t in outputs] + [arg["buf:" + b[0]] for b in buffers]
    params += [arg["tma:" + t] for t, *_ in tma]
    lines = []
    grids = []
    for k, (plan, cfg) in enumerate(parts):
        src = Source()
        PartKernel(graph, plan, cfg, arg, strides, src, interpret, wide, group_names).emit()
        lines.append("@triton.jit")
        lines.append(f"def _part{k}(pid, {', '.join(params)}, PHASE: tl.constexpr):")
        lines += src.lines
        lines.append("")
        grids.append(programs(plan, cfg))
    name = kernel_name(title)
    lines += _dispatch(params, grids, name)
    n_phases = max(len(phase_stages(graph, p, c)) for p, c in parts)
    warps = max(c.num_warps for _, c in parts)
    group = max((c.split for _, c in parts if c.coop), default=0)
    body = "\n".join(lines) + "\n"
    source = header(title, interpret, body) + "\n" + body
    gluon = any(cfg.tma or cfg.cp_async for _, cfg in parts)
    if gluon:  # one part (see _streamed_inputs): its tile and warps lay out every tensor
        plan, cfg = parts[0]
        source = to_gluon(source, blocked_layout(cfg.BP, cfg.num_warps, plan.big_elem_bytes, plan.p_contiguous))
    cooperative = any(c.coop and c.persistent for _, c in parts)
    fills = tuple((scatter.name, scatter_identity(scatter.reduce, graph.type_of[scatter.name].dtype))
                  for plan, _ in parts for _, scatter in plan.scatters)
    return KernelSpec(source, name, tuple(inputs), tuple(outputs), tuple(buffers), sum(grids), n_phases, warps,
                      group, tuple(tma), gluon, cooperative, fills)


def _streamed_inputs(graph: Graph, parts, arg: dict, strides: dict, interpret: bool, wide: bool,
                     group_names: set) -> list[tuple]:
    """(input, box, view) for the pieces a TMA config streams (codegen_tma), naming their descriptor
    parameters in `arg`; none for cp.async pieces. Raises GluonRefusal where the streamed path
    cannot take a part."""
    streamed = [(plan, cfg) for plan, cfg in parts if cfg.tma or cfg.cp_async]
    if not streamed:
        return []
    if len(parts) > 1:
        raise GluonRefusal("a cooperative part with streamed pieces cannot share its launch with packed parts")
    plan, cfg = streamed[0]
    probe = PartKernel(graph, plan, cfg, arg, strides, Source(), interpret, wide, group_names)
    if cfg.cp_async:
        probe.cp_async_refusal()
        return []
    out = []
    for k, t in enumerate(probe.tma_tensors()):
        arg["tma:" + t] = f"desc{k}"
        out.append((t, *probe.tma_box_of(t)))
    return out


def kernel_name(title: str) -> str:
    """The launched function's name, from the group's title without its region and the nodes' numbers
    ("r6:mul_6..softmax_2" -> "sf_mul__softmax"), so that profiles say what a generated kernel does,
    and kernels alike but for names (a ResNet's repeated blocks) are one source, compiled once (the
    parameters are numbered, not named, for the same reason)."""
    body = re.sub(r"_\d+(?![0-9A-Za-z])", "", title.split(":", 1)[-1])
    return ("sf_" + _ident(body.replace("..", "__")))[:96]


def _dispatch(params, grids, name: str = "kernel") -> list[str]:
    """The launched function (`name`; the module also binds it as `kernel`)."""
    args = ", ".join(params)
    lines = ["@triton.jit", f"def {name}({args}, PHASE: tl.constexpr):", "    pid = tl.program_id(0)"]
    alias = ["", "", f"kernel = {name}"] if name != "kernel" else []
    if len(grids) == 1:
        return lines + [f"    _part0(pid, {args}, PHASE)"] + alias
    start = 0
    for k, g in enumerate(grids):
        cond = "if" if k == 0 else "elif"
        test = f"pid < {start + g}" if k < len(grids) - 1 else ""
        lines.append(f"    {cond} {test}:" if test else "    else:")
        lines.append(f"        _part{k}(pid - {start}, {args}, PHASE)")
        start += g
    return lines + alias


def kernel_inputs(graph: Graph, nodes, group_names: set) -> list[str]:
    """External tensors the nodes read, including those of producers they inline."""
    found: list[str] = []

    def visit(n):
        for t in n.inputs:
            if t in group_names:
                if t not in own:
                    visit(graph.node_of[t])
            elif t not in found:
                found.append(t)

    own = {n.name for n in nodes}
    for n in nodes:
        visit(n)
        for t in n.inputs:  # inlined reads of this kernel's own nodes need their inputs too
            if t in own:
                visit(graph.node_of[t])
    return found


def _io(graph: Graph, parts, group_names: set) -> tuple[list[str], list[str]]:
    inputs = kernel_inputs(graph, [n for plan, _ in parts for n in part_nodes(plan)], group_names)
    outputs = [o for plan, _ in parts for o in stored(plan)]
    return inputs, outputs


def _needs_int64(graph: Graph, tensors, strides: dict) -> bool:
    for t in tensors:
        shape = graph.type_of[t].shape
        top = sum((n - 1) * s for n, s in zip(shape, strides[t]))
        if top >= 2**31 - 1:
            return True
    return False
