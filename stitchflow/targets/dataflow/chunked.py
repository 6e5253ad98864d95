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
from dataclasses import dataclass

import numpy as np
import torch

from .graph import Dataflow, Prim
from .region_run import RegionRun
from .stream import ELEM, Stream
from .timing import Timing

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


def run_chunk(run: RegionRun, plan: Chunking, lo: int, hi: int | None, persistent: dict, persistent_times: dict,
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
    run.run_prims(plan.per_chunk, vals, times, dict(uses), keep, persistent)
    return {s: vals[s] for p in plan.per_chunk for s in p.outs if s in keep}


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
    Otherwise updates env with the outputs and returns (run, chunks): the RegionRun's totals
    are the whole region's. Without `timing` it only
    computes (a program's call); `stats` receives the tokens per primitive kind."""
    plan = why_not_chunked(df)
    if isinstance(plan, str):
        return None
    run = RegionRun(df, env, timing, {} if stats is not None else None)
    for p in plan.once + plan.frontier:
        run.vals.update(zip(p.outs, run.fire(p, run.vals, run.times)))
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
