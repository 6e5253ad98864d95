"""A region run in chunks of its loops' outer coordinates, so that its streams need not all fit
in memory.

The fast engine holds a region's streams whole (about 10 bytes a token), so a region of a few
billion tokens does not fit a workstation. A region is one loop nest or a few in sequence (a
hoisted full fusion: layer 1 into a buffer, then layer 2 reading it), joined by results outside
every loop. Below a nest's outer fiber every stream belongs to one coordinate v0 of its outer
variable, so the nest runs over ranges of v0's coordinates: the outer level's scanners run once
over the whole fiber, and each chunk runs the nest's body on their tokens within its range,
closed by the fiber's stop and done, as if the outer fiber held only those coordinates.

The nest's exits (the primitives whose results leave it) add up over chunks: writers write
disjoint rows (v0 is their first coordinate) of one array that every chunk fills; accumulators
either keep v0 (disjoint entries) or sum over it (partial sums, merged by coordinate). Later
nests read the added results.

Timing continues across chunks: a primitive's first step in a chunk fires no earlier than the
step after its last real one of the previous chunk, and its tokens leave no earlier than its
last real token did, so a chunk starts while the one before drains, as in the whole run. Real
means the whole run has it there too: a chunk also appends its closing done (and the outer
fiber's stop, to a stream of the outer level), which may wait on slower inputs, and the next
chunk does not wait for those. Cycles agree within a few cycles a chunk (exactly on the apps'
regions, tests/targets/dataflow/test_chunked.py), and the counters are the whole run's, the
closing tokens counted once.

Legality is `why_not_chunked`; the heuristic, `run_in_chunks`, measures the tokens of 1/64 of a
nest's outer coordinates with a throwaway run and chunks the nest only when its extrapolated
tokens pass the budget; a region of one nest that fits runs whole, exactly as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .graph import Dataflow, Prim
from . import storage as S
from .execute import DENSE_ACC_LIMIT, blank_output, finish_output
from .region_run import RegionRun, release, uses_of
from .stream import ELEM, Stream
from .timing import Timing

CHUNK_TOKENS = 200_000_000  # a region of more tokens runs in chunks of its outer loop (~2 GB each)
WRITERS = ("write", "buffer_write")
PROBE_FRACTION = 64  # the probe chunk holds 1/64 of the outer coordinates
STORAGE_KINDS = ("storage", "tensor")


@dataclass(frozen=True)
class Nest:
    """One loop nest of a region: the scanners of its outer level run once over the whole fiber,
    the body once a chunk of their coordinates. `exits` are the body's primitives whose results
    leave the nest (writers, accumulators over its variables); they add up over chunks."""

    outer: str
    frontier: tuple[Prim, ...]
    body: tuple[Prim, ...]
    exits: tuple[Prim, ...]

    def __str__(self) -> str:
        return f"nest {self.outer}: {len(self.frontier)} outer scanners, {len(self.body)} a chunk"


@dataclass(frozen=True)
class Chunking:
    """How a region splits: its loop nests, in order, with the primitives outside every loop
    (loads, the roots of later nests) between them."""

    phases: tuple[Nest | tuple[Prim, ...], ...]

    @property
    def nests(self) -> tuple[Nest, ...]:
        return tuple(x for x in self.phases if isinstance(x, Nest))

    def __str__(self) -> str:
        return "chunks over " + "; ".join(map(str, self.nests))


@dataclass
class _OpenNest:
    """A nest while why_not_chunked gathers it."""

    outer: str
    before: list  # primitives outside every loop that run before it
    frontier: list = field(default_factory=list)
    body: list = field(default_factory=list)
    exits: list = field(default_factory=list)
    made: set = field(default_factory=set)
    exit_outs: set = field(default_factory=set)

    def freeze(self) -> Nest | str:
        if not self.frontier:
            return f"no scanner of the outer level {self.outer}"
        return Nest(self.outer, tuple(self.frontier), tuple(self.body), tuple(self.exits))

    def classify(self, p: Prim, depth: dict) -> str | None:
        """File a primitive of the nest as an outer scanner, a body primitive or an exit."""
        deep_in = [s for s in p.ins if depth[s]]
        deep_out = [s for s in p.outs if depth[s]]
        if p.kind in ("fork", "join_lanes") and any(depth[s] == (self.outer,) for s in p.ins + p.outs):
            return f"{p} deals lanes at the outer level {self.outer} (their assignment would restart a chunk)"
        if any(s in self.exit_outs for s in p.ins):
            return f"{p} reads a result of the loop over {self.outer} inside it"
        self.made.update(p.outs)
        if not deep_in:
            if p.kind not in ("scan", "range"):
                return f"the outer level is produced by {p}, not a scanner"
            self.frontier.append(p)
            return None
        if any(s not in self.made for s in deep_in):
            return f"{p} reads the loop over {self.outer} of an earlier nest"
        self.body.append(p)
        if deep_out:
            return None
        self.exits.append(p)
        self.exit_outs.update(p.outs)
        return _exit_legality(p, self.outer, depth)


def why_not_chunked(df: Dataflow) -> Chunking | str:
    """The region's split into loop nests whose outer coordinates can run in chunks, or why it
    cannot be split. Legality only; run_in_chunks decides which nests need chunks."""
    if not df.order:
        return "the region has no loop"
    depth = {s.id: s.depth for s in df.streams}
    phases: list = []  # nests, and lists of the primitives outside every loop between them
    flat: list = []  # such primitives since the last nest closed
    nest: _OpenNest | None = None
    for p in df.prims:
        loops = {depth[s][0] for s in p.ins + p.outs if depth[s]}
        if len(loops) > 1:
            return f"{p} spans the loops over {' and '.join(sorted(loops))}"
        if not loops and nest is not None and not any(s in nest.made for s in p.ins):
            nest.before.append(p)  # it does not need the open nest: it runs before it
            continue
        if nest is not None and (not loops or nest.outer not in loops):
            phases.append(nest.freeze())
            nest = None
        if not loops:
            flat.append(p)
            continue
        if nest is None:
            nest, flat = _OpenNest(loops.pop(), flat), []
            phases.append(nest.before)
        why = nest.classify(p, depth)
        if why:
            return why
    if nest is not None:
        phases.append(nest.freeze())
    why = next((x for x in phases if isinstance(x, str)), None)
    if why:
        return why
    phases = [x if isinstance(x, Nest) else tuple(x) for x in phases + [flat]]
    if not any(isinstance(x, Nest) for x in phases):
        return "the region has no loop"
    return Chunking(tuple(x for x in phases if isinstance(x, Nest) or x))


def _exit_legality(p: Prim, outer: str, depth: dict) -> str | None:
    """Chunks' results add up: writers write disjoint rows of the outer variable; accumulators
    either keep it (disjoint) or sum over it (partial sums add)."""
    if p.kind in WRITERS:
        if depth[p.ins[0]] != (outer,):
            return f"{p} does not write {outer} as its first coordinate"
        return None
    if p.kind in ("spacc", "buffer"):
        crds = p.ins[1:-1]
        over_outer = any(depth[crds[k]][-1] == outer for k in (p.param("reduced") or ()))
        if over_outer and p.param("op") != "sum":
            return f"{p} takes the {p.param('op')} over the outer variable {outer} (partial results do not add)"
        return None
    return f"{p} reduces over the outer variable {outer}"


def outer_coordinates(frontier_vals: dict, nest: Nest) -> np.ndarray:
    """Every coordinate of the outer level that some scanner emits, in order."""
    coords = []
    for p in nest.frontier:
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


def _sliced(run: RegionRun, nest: Nest, lo: int, hi: int | None, timed: bool) -> tuple[dict, dict, set]:
    """The region's live values (and times) with the outer scanners' streams cut to [lo, hi), and
    which of them live on after the chunk (all but those streams)."""
    vals, times = dict(run.vals), dict(run.times) if timed else {}
    persistent = set(run.vals) - {s for p in nest.frontier for s in p.outs}
    for p in nest.frontier:
        crd = run.vals[p.outs[0]]
        for s in p.outs:
            sliced, pick, before = _slice(run.vals[s], crd, lo, hi)
            vals[s] = sliced
            if timed:
                n_elems = int(np.count_nonzero(sliced.kind == ELEM))
                times[s] = _slice_times(run.times[s], pick, n_elems, before)
                run.ctx.lengths[s] = len(sliced)
    return vals, times, persistent


def run_chunk(run: RegionRun, nest: Nest, lo: int, hi: int | None, keep: set) -> tuple[dict, dict]:
    """Run the nest's body over outer coordinates [lo, hi); returns its exits' results and times."""
    vals, times, persistent = _sliced(run, nest, lo, hi, run.timing is not None)
    run.run_prims(nest.body, vals, times, uses_of(nest.body), keep, persistent)
    outs = [s for p in nest.exits for s in p.outs]
    return {s: vals[s] for s in outs}, {s: times[s] for s in outs if s in times}


def _probe(run: RegionRun, nest: Nest, coords: np.ndarray, keep: set) -> float:
    """Tokens a coordinate of the nest's body makes, measured on its first 1/64 of the outer
    coordinates by a run that computes only (its results are thrown away)."""
    n = min(len(coords) - 1, max(1, math.ceil(len(coords) / PROBE_FRACTION)))
    probe = RegionRun(run.df, run.env, None)
    probe.outer, probe.final = nest.outer, False  # closing tokens are not the nest's
    vals, _, persistent = _sliced(run, nest, int(coords[0]), int(coords[n]), timed=False)
    probe.run_prims(nest.body, vals, {}, uses_of(nest.body), keep, persistent)
    return max(1, probe.tokens) / n


def merge_storages(*parts: S.Storage) -> S.Storage:
    """The storage holding every part's entries, values at equal coordinates summed (one sort for
    all the chunks' parts: merging them pairwise would sort the growing result once a chunk)."""
    coords = np.concatenate([S.coords_of_positions(p) for p in parts])
    values = np.concatenate([p.values for p in parts])
    order = np.lexsort(coords.T[::-1]) if coords.shape[1] else np.arange(len(coords))
    coords, values = coords[order], values[order]
    new = np.ones(len(coords), bool)
    new[1:] = (coords[1:] != coords[:-1]).any(axis=1)
    starts = np.flatnonzero(new)
    summed = np.add.reduceat(values, starts, axis=0) if len(values) else values
    levels = parts[0].levels
    kinds, sizes = tuple(lv.kind for lv in levels), tuple(lv.size for lv in levels)
    return S.from_coo(coords[starts], summed, sizes, kinds, parts[0].tile, presorted=True)


class DenseSum:
    """An accumulator's partial sums over chunks, added as each chunk ends into one array indexed
    by flattened coordinate (in chunk order: float64 sums in another order than one merge's, to
    rounding); `seen` marks the coordinates some part stored (the merged storage keeps exactly
    those). Holding every part for one merge_storages at the nest's end grew by a part a chunk and
    then concatenated and sorted all their coordinates: GraphSAGE's X·W_self on ogbn-mag (k
    outermost, 29 parts of 16 x 736,389 entries) held 5 GB of parts and passed 13 GB in the merge
    (~28 GB by a 1/16-scale measure); this holds 0.1 GB."""

    def __init__(self, like: S.Storage):
        self.sizes = tuple(lv.size for lv in like.levels)
        self.kinds, self.tile = tuple(lv.kind for lv in like.levels), like.tile
        self.acc = np.zeros((math.prod(self.sizes),) + like.values.shape[1:], np.float64)
        self.seen = np.zeros(math.prod(self.sizes), bool)

    @staticmethod
    def fits(part: S.Storage) -> bool:
        return math.prod(lv.size for lv in part.levels) * math.prod(part.values.shape[1:]) <= DENSE_ACC_LIMIT

    def add(self, part: S.Storage) -> None:
        key = np.ravel_multi_index(tuple(S.coords_of_positions(part).T), self.sizes)
        self.acc[key] += part.values  # a storage's coordinates are unique: no two writes to one key
        self.seen[key] = True

    def storage(self) -> S.Storage:
        present = np.flatnonzero(self.seen)
        coords = np.stack(np.unravel_index(present, self.sizes), axis=1)
        return S.from_coo(coords, self.acc[present], self.sizes, self.kinds, self.tile, presorted=True)


def add_part(held: list | DenseSum, part: S.Storage) -> list | DenseSum:
    """`held` (the parts so far) with `part` added: from the second part on, a DenseSum where
    the accumulator's dense array fits DENSE_ACC_LIMIT, else the list for merge_storages."""
    if isinstance(held, DenseSum):
        held.add(part)
        return held
    held.append(part)
    if len(held) == 2 and DenseSum.fits(part):
        dense = DenseSum(part)
        for x in held:
            dense.add(x)
        return dense
    return held


def merge_parts(held: list | DenseSum) -> S.Storage:
    if isinstance(held, DenseSum):
        return held.storage()
    return merge_storages(*held) if len(held) > 1 else held[0]


def run_in_chunks(df: Dataflow, env: dict, timing: Timing | None, budget: int = CHUNK_TOKENS, progress=None,
                  stats: dict | None = None):
    """Run the region nest by nest, each over chunks of its outer coordinates of about `budget`
    tokens (one chunk: the nest whole, exactly). Returns None (nothing run, env untouched) when
    the region cannot be chunked or is one nest that fits the budget: run it whole then.
    Otherwise updates env with the outputs and returns (run, chunks), chunks the most of any
    nest: the RegionRun's totals are the whole region's. Without `timing` it only computes (a
    program's call); `stats` receives the tokens per primitive kind."""
    plan = why_not_chunked(df)
    if isinstance(plan, str):
        return None
    run = RegionRun(df, env, timing, {} if stats is not None else None)
    uses, keep = uses_of(df.prims), {o.stream for o in df.outputs}
    nests = plan.nests
    most = 1
    for phase in plan.phases:
        if not isinstance(phase, Nest):
            run.run_prims(phase, run.vals, run.times, uses, keep)
            continue
        k = nests.index(phase)
        tick = None if progress is None else (lambda f, k=k: progress((k + f) / len(nests)))
        chunks = _run_nest(run, phase, budget, uses, keep, tick, single=len(nests) == 1)
        if chunks is None:
            return None
        most = max(most, chunks)
    env.update({o.name: run.vals[o.stream] for o in df.outputs})
    if stats is not None:
        stats.update(run.stats)
    return run, most


def _run_nest(run: RegionRun, nest: Nest, budget: int, uses: dict, keep: set, progress, single: bool) -> int | None:
    """Run one nest, in chunks when its tokens pass the budget; returns the chunks, or None when
    the region is this one nest and it fits (the caller then runs the region whole)."""
    run.outer = nest.outer  # the closing tokens a chunk adds are this nest's
    run.run_prims(nest.frontier, run.vals, run.times, uses, keep)
    coords = outer_coordinates(run.vals, nest)
    per_coordinate = _probe(run, nest, coords, keep) if len(coords) > 1 else 0.0
    if per_coordinate * len(coords) <= budget:
        if single:
            return None
        run.run_prims(nest.body, run.vals, run.times, uses, keep)
        if progress is not None:
            progress(1.0)
        return 1
    # writers' chunks fill disjoint rows of one array, not an array each to be added up
    run.into = {p.id: blank_output(p) for p in nest.exits if p.kind in WRITERS}
    parts: dict = {}
    start, chunks = 0, 0
    while start < len(coords):
        stop = min(len(coords), start + max(1, int(budget / per_coordinate)))
        before = run.tokens
        run.final = stop == len(coords)
        outs, times = run_chunk(run, nest, int(coords[start]), int(coords[stop]) if stop < len(coords) else None,
                                keep)
        chunks += 1
        for s, o in outs.items():
            if isinstance(o, S.Storage):  # an accumulator's part: added up by coordinate
                parts[s] = add_part(parts.get(s, []), o)
        if progress is not None:
            progress(stop / len(coords))
        per_coordinate = max(1, run.tokens - before) / (stop - start)
        start = stop
    results = {s: merge_parts(held) for s, held in parts.items()}
    for p in nest.exits:
        if p.id in run.into:
            results[p.outs[0]] = finish_output(p, run.into.pop(p.id))
    run.vals.update(results)
    run.times.update(times)  # the last chunk's: an exit's result leaves when its last part does
    for p in nest.body:  # what the body read is used up
        release(p, run.vals, run.times, uses, keep)
    return chunks
