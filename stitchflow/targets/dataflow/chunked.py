"""A region run in chunks of its outermost loop, so that its streams need not all fit in memory.

The fast engine holds a region's streams whole (about 10 bytes a token), so a region of a few
billion tokens does not fit a workstation. Most regions are one loop nest whose outermost
variable v0 indexes independent work: every stream below the outer fiber belongs to one v0
coordinate. Such a region runs over ranges of v0's coordinates: the outer level's scanners run
once over the whole fiber, and each chunk runs the rest of the graph on their tokens within its
range, closed by the fiber's stop and done, as if the outer fiber held only those coordinates.
Writers write disjoint rows (v0 is their first coordinate), so the chunks' outputs add up.

Timing continues across chunks: a primitive's first step in a chunk fires no earlier than the
step after its last real one of the previous chunk, and its tokens leave no earlier than its
last real token did, so a chunk starts while the one before drains, as in the whole run. Real
means the whole run has it there too: a chunk also appends its closing done (and the outer
fiber's stop, to a stream of the outer level), which may wait on slower inputs, and the next
chunk does not wait for those. They are what remains of the difference: cycles agree within a
few cycles a chunk (Cora's GCN per layer, 35.1 M cycles: +2 in 3 chunks), and the counters are
the whole run's, the closing tokens counted once.

Legality is `why_not_chunked`; the heuristic, `run_in_chunks`, probes 1/64 of v0's coordinates
and runs the region whole (exactly as before) when its extrapolated tokens fit the budget.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from .counters import count, total
from .execute import FUNCS
from .graph import Dataflow, Prim
from .stream import ELEM, Stream
from .timing import Context, Timing, schedule

CHUNK_TOKENS = 200_000_000  # a region of more tokens runs in chunks of its outer loop (~2 GB each)
WRITERS = ("write", "buffer_write")
PROBE_FRACTION = 64  # the probe chunk holds 1/64 of the outer coordinates
STORAGE_KINDS = ("storage", "tensor")


@dataclass(frozen=True)
class Chunking:
    """How a region splits: the depth-0 primitives run once, the frontier (scanners of the outer
    level) once over the whole fiber, the rest once a chunk."""

    outer: str
    once: tuple[Prim, ...]
    frontier: tuple[Prim, ...]
    per_chunk: tuple[Prim, ...]

    def __str__(self) -> str:
        return (f"chunks over {self.outer}: {len(self.once)} once, {len(self.frontier)} outer scanners, "
                f"{len(self.per_chunk)} a chunk")


def why_not_chunked(df: Dataflow) -> Chunking | str:
    """The region's split into chunks of its outermost variable, or why it cannot be split."""
    if not df.order:
        return "the region has no loop"
    outer = df.order[0]
    depth = {s.id: s.depth for s in df.streams}
    consumed = {s for p in df.prims for s in p.ins}
    once, frontier, per_chunk = [], [], []
    for p in df.prims:
        deep_in = [s for s in p.ins if depth[s]]
        deep_out = [s for s in p.outs if depth[s]]
        if p.kind in ("fork", "join_lanes") and any(depth[s] == (outer,) for s in p.ins + p.outs):
            return f"{p} deals lanes at the outer level {outer} (their assignment would restart a chunk)"
        if not deep_in and not deep_out:
            once.append(p)
        elif not deep_in:
            if p.kind not in ("scan", "range"):
                return f"the outer level is produced by {p}, not a scanner"
            frontier.append(p)
        elif deep_out or p.kind not in WRITERS:
            if not deep_out:
                return f"{p} reduces over the outer variable {outer}"
            per_chunk.append(p)
        elif any(s in consumed for s in p.outs):
            return f"{p} writes a buffer the region reads again"
        elif not p.ins or depth[p.ins[0]] != (outer,):
            return f"{p} does not write {outer} as its first coordinate"
        else:
            per_chunk.append(p)
    if not frontier:
        return "no scanner of the outer level"
    return Chunking(outer, tuple(once), tuple(frontier), tuple(per_chunk))


class _Run:
    """One region's state across chunks: the values and timestamps that live for the whole
    region, what each primitive carries to the next chunk, and the totals."""

    def __init__(self, df: Dataflow, env: dict, timing: Timing | None, outer: str, stats: dict | None = None):
        self.df, self.env, self.timing, self.outer, self.stats = df, env, timing, outer, stats
        self.depth = {s.id: s.depth for s in df.streams}
        self.ctx = Context.of(df, timing) if timing is not None else None
        self.vals: dict = {}
        self.times: dict = {}
        self.steps: dict = {}
        self.finish: dict = {}
        self.counters: dict = {}
        self.next_step: dict = {}  # prim id -> earliest time of its next step
        self.last_emit: dict = {}  # stream id -> time its last token left
        self.tokens = 0
        self.final = True  # False while a chunk other than the last runs

    def closers(self, sid: int, out) -> int:
        """Tokens a chunk appends to a stream that the whole run has only once, at its end: the
        done, and the outer fiber's stop in a stream of the outer level (deeper streams' last
        stop is the whole run's stop at that place, raised a level)."""
        if not isinstance(out, Stream) or not self.depth.get(sid):
            return 0
        return 2 if self.depth[sid] == (self.outer,) else 1

    def last_real_step(self, p: Prim, outs, sched) -> int:
        """The step that emits the primitive's last token of this chunk that the whole run has
        too: the next chunk's first step follows it (not the closers, which may wait longer)."""
        last = -1
        for o, (s, out) in enumerate(zip(p.outs, outs)):
            real = len(out) - self.closers(s, out) if isinstance(out, Stream) else 0
            if real > 0:
                emit = sched.emit[o]
                last = max(last, int(emit[real - 1]) if emit is not None else real - 1)
        return last if last >= 0 else sched.n - 1

    def fire(self, p: Prim, vals: dict, times: dict) -> list:
        """Run one primitive on this chunk's streams; returns its outputs."""
        from .simulate import emitted_all, finish_of, fire, ready

        args = [vals[s] for s in p.ins]
        outs = FUNCS[p.kind](p, args, self.env)
        # a chunk's closing tokens count once, with the last chunk (the whole run has them once)
        extra = 0 if self.final else sum(self.closers(s, o) for s, o in zip(p.outs, outs))
        made = sum(len(o) for o in outs if isinstance(o, Stream)) - extra
        self.tokens += made
        if self.stats is not None:
            self.stats[p.kind] = self.stats.get(p.kind, 0) + made
        if self.timing is None:
            return outs
        for s, o in zip(p.outs, outs):
            self.ctx.lengths[s] = len(o) if isinstance(o, Stream) else len(args[-1]) if p.kind in ("spacc", "buffer") else 1
        sched = schedule(p, args, outs, self.timing, self.ctx)
        x = ready(sched, [times[s] for s in p.ins])
        if sched.n and p.id in self.next_step:
            x[0] = max(x[0], self.next_step[p.id])
        t = fire(sched, x)
        es = emitted_all(sched, t)
        for s, e in zip(p.outs, es):
            if len(e) and s in self.last_emit:
                e[0] = max(e[0], self.last_emit[s])
                np.maximum.accumulate(e, out=e)
        for s, o, e in zip(p.outs, outs, es):
            times[s] = e
            real = len(e) - self.closers(s, o)
            if real > 0:
                self.last_emit[s] = int(e[real - 1])
        if sched.n:
            last = self.last_real_step(p, outs, sched)
            ii = sched.ii[last] if isinstance(sched.ii, np.ndarray) else sched.ii
            self.next_step[p.id] = int(t[last] + ii)
            self.finish[p.id] = max(self.finish.get(p.id, 0), finish_of(sched, t, es))
        self.steps[p.id] = self.steps.get(p.id, 0) + sched.n
        c = count(p, args, outs, self.ctx, self.timing.crd_bytes, self.timing.value_bytes)
        c = replace(c, tokens=c.tokens - extra)
        self.counters[p.id] = c + self.counters[p.id] if p.id in self.counters else c
        return outs


def outer_coordinates(frontier_vals: dict, plan: Chunking) -> np.ndarray:
    """Every coordinate of the outer level that some scanner emits, in order."""
    coords = []
    for p in plan.frontier:
        crd = frontier_vals[p.outs[0]]
        elem = crd.kind == ELEM
        last_elem = np.flatnonzero(elem)
        if len(last_elem) and not elem[: last_elem[-1] + 1].all():
            raise ValueError(f"chunked simulation: {p} emits control tokens inside the outer fiber")
        coords.append(crd.ival[elem])
    return np.unique(np.concatenate(coords)) if coords else np.zeros(0, np.int64)


def _slice(stream: Stream, crd: Stream, lo: int, hi: int | None) -> tuple[Stream, np.ndarray, int]:
    """The tokens of an outer-level stream whose coordinate lies in [lo, hi), then its closing
    tokens; also where they came from and the index of the last element before the range."""
    elem = crd.kind == ELEM
    inside = elem & (crd.ival >= lo)
    if hi is not None:
        inside &= crd.ival < hi
    before = np.flatnonzero(elem & (crd.ival < lo))
    pick = np.concatenate((np.flatnonzero(inside), np.flatnonzero(~elem)))
    fval = None if stream.fval is None else stream.fval[pick]
    return Stream(stream.kind[pick], stream.ival[pick], fval), pick, int(before[-1]) if len(before) else -1


def _slice_times(t: np.ndarray, pick: np.ndarray, n_elems: int, before: int) -> np.ndarray:
    """Elements keep their whole-run times; the closing tokens follow the chunk's last element
    (or the last element before it) one cycle apart, as if the fiber ended there."""
    out = t[pick].copy()
    closers = len(pick) - n_elems
    last = out[n_elems - 1] if n_elems else (t[before] if before >= 0 else t[0])
    out[n_elems:] = last + np.arange(1, closers + 1)
    return out


def run_chunk(run: _Run, plan: Chunking, lo: int, hi: int | None, persistent: dict, persistent_times: dict,
              uses: dict, keep: set) -> dict:
    """Run the per-chunk primitives over outer coordinates [lo, hi); returns the writers' outputs."""
    vals, times = dict(persistent), dict(persistent_times)
    for p in plan.frontier:
        crd = run.vals[p.outs[0]]
        for s in p.outs:
            sliced, pick, before = _slice(run.vals[s], crd, lo, hi)
            vals[s] = sliced
            if run.timing is not None:
                n_elems = int(np.count_nonzero(sliced.kind == ELEM))
                times[s] = _slice_times(run.times[s], pick, n_elems, before)
                run.ctx.lengths[s] = len(sliced)
    left = dict(uses)
    written = {}
    for p in plan.per_chunk:
        outs = run.fire(p, vals, times)
        for s, o in zip(p.outs, outs):
            vals[s] = o
            if s in keep:
                written[s] = o
        for s in p.ins:
            left[s] -= 1
            if left[s] == 0 and s not in persistent:
                vals.pop(s, None)
                times.pop(s, None)
    return written


def _chunk_uses(plan: Chunking) -> dict:
    uses: dict = {}
    for p in plan.per_chunk:
        for s in p.ins:
            uses[s] = uses.get(s, 0) + 1
    return uses


def _add(acc, out):
    if acc is None:
        return out
    if out.dtype == torch.bool:
        return acc | out
    acc += out
    return acc


def run_in_chunks(df: Dataflow, env: dict, timing: Timing | None, budget: int = CHUNK_TOKENS, progress=None,
                  stats: dict | None = None):
    """Run the region over chunks of its outer coordinates of about `budget` tokens each.
    Returns None (nothing run, env untouched) when the region cannot be chunked or its tokens,
    extrapolated from a probe of 1/64 of the coordinates, fit the budget: run it whole then.
    Otherwise updates env with the outputs and returns (run, chunks). Without `timing` it only
    computes (a program's call); `stats` receives the tokens per primitive kind."""
    plan = why_not_chunked(df)
    if isinstance(plan, str):
        return None
    run = _Run(df, env, timing, plan.outer, {} if stats is not None else None)
    for p in plan.once + plan.frontier:
        outs = run.fire(p, run.vals, run.times)
        run.vals.update(zip(p.outs, outs))
    coords = outer_coordinates(run.vals, plan)
    if len(coords) < 2:
        return None
    frontier_outs = {s for p in plan.frontier for s in p.outs}
    persistent = {s: v for s, v in run.vals.items() if s not in frontier_outs}
    persistent_times = {s: t for s, t in run.times.items() if s not in frontier_outs}
    uses, keep = _chunk_uses(plan), {o.stream for o in df.outputs}
    written: dict = {}
    start, chunks, probed = 0, 0, False
    size = max(1, math.ceil(len(coords) / PROBE_FRACTION))
    while start < len(coords):
        stop = min(len(coords), start + size)
        before = run.tokens
        run.final = stop == len(coords)
        outs = run_chunk(run, plan, int(coords[start]), int(coords[stop]) if stop < len(coords) else None,
                         persistent, persistent_times, uses, keep)
        chunks += 1
        made = max(1, run.tokens - before)
        if not probed:
            probed = True
            if made * len(coords) / (stop - start) <= budget:
                return None
        for s, o in outs.items():
            written[s] = _add(written.get(s), o)
        if progress is not None:
            progress(stop / len(coords))
        per_coordinate = made / (stop - start)
        size = max(1, int(budget / per_coordinate))
        start = stop
    env.update({o.name: written[o.stream] for o in df.outputs})
    if stats is not None:
        stats.update(run.stats)
    return run, chunks


def chunked_region_result(run: _Run, chunks: int, started: float):
    """The RegionResult of a chunked run (imported lazily by simulate.run_region)."""
    from .simulate import PrimResult, RegionResult

    prims = tuple(PrimResult(str(p), p.kind, run.steps.get(p.id, 0), run.finish.get(p.id, 0),
                             run.counters[p.id]) for p in run.df.prims)
    cycles = max((r.finish for r in prims), default=0)
    return RegionResult(run.df.region, cycles, total(r.counters for r in prims), prims,
                        time.perf_counter() - started, chunks)
