"""Cycle-level simulation of compiled dataflow programs (issue 4), fast engine.

Every primitive is run functionally (execute.FUNCS, whole streams as numpy arrays) in the
graph's topological order; right after, its schedule (timing.py) turns its input streams'
timestamps into its own: the recurrence T[s] = max(X[s], T[s-1] + ii[s-1]) has the closed
form T = C + cummax(X - C) with C the running sum of the intervals, so a primitive costs a
few numpy passes over its tokens. Streams and timestamps are freed after their last consumer.

Bounded channels (a producer cannot emit token k before each consumer has dequeued token
k - depth) make a producer depend on its consumers: the schedules are kept and stepped.py
fires them token by token in compiled loops (the reference's algorithm, cycle_engine.py);
a round in which nothing fires is a deadlock. engine="stepped" uses that loop unbounded too.

Between regions intermediates go through memory: a program's cycles are the sum of its
regions' (they run one after another), and so are its counters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ...ir.errors import StitchflowError
from .chunked import CHUNK_TOKENS, chunked_region_result, run_in_chunks
from .counters import Counters, count, total
from .execute import FUNCS
from .graph import Dataflow
from .kernels import emit_times, fire_array, fire_scalar, ready_gather
from .stepped import run_stepped
from .stream import Stream
from .timing import Context, Schedule, Timing, schedule


class Deadlock(StitchflowError, RuntimeError):
    """Bounded channels too shallow for the graph: some primitive waits forever."""


@dataclass(frozen=True)
class PrimResult:
    prim: str
    kind: str
    steps: int
    finish: int
    counters: Counters


@dataclass(frozen=True)
class RegionResult:
    region: str
    cycles: int
    counters: Counters
    prims: tuple[PrimResult, ...]
    seconds: float = 0.0
    chunks: int = 1  # > 1: run in chunks of its outermost loop (chunked.py)

    def __str__(self) -> str:
        chunks = f" ({self.chunks} chunks)" if self.chunks > 1 else ""
        return f"{self.region}: {self.cycles:,} cycles{chunks}; {self.counters}"


@dataclass(frozen=True)
class SimResult:
    outputs: object
    cycles: int
    regions: tuple[RegionResult, ...]
    counters: Counters
    timing: Timing
    seconds: float = 0.0

    @property
    def flops(self) -> int:
        return self.counters.flops

    @property
    def bytes(self) -> int:
        return self.counters.bytes

    @property
    def tokens(self) -> int:
        return self.counters.tokens

    def as_dict(self) -> dict:
        return {"cycles": self.cycles, "seconds": round(self.seconds, 3), "totals": self.counters.as_dict(),
                "regions": [{"region": r.region, "cycles": r.cycles, "counters": r.counters.as_dict(),
                             "seconds": round(r.seconds, 3), "chunks": r.chunks} for r in self.regions]}

    def __str__(self) -> str:
        lines = [f"total: {self.cycles:,} cycles; {self.counters}"]
        lines += [f"  {r}" for r in self.regions]
        return "\n".join(lines)


# ---------------------------------------------------------------- the recurrences, vectorised

def ready(sched: Schedule, in_times: list) -> np.ndarray:
    """X[s]: when every input token step s needs has arrived (and the start-up delay)."""
    x = np.zeros(sched.n, np.int64)
    for need, t in zip(sched.need, in_times):
        if need is None:
            np.maximum(x, t, out=x)
        else:
            ready_gather(x, t, need)
    if sched.n:
        x[0] = max(x[0], sched.start)
    return x


def fire(sched: Schedule, x: np.ndarray) -> np.ndarray:
    """T[s] = max(X[s], T[s-1] + ii[s-1]): each step as early as its inputs and the interval
    allow (in place on x)."""
    if isinstance(sched.ii, np.ndarray):
        fire_array(x, sched.ii)
    else:
        fire_scalar(x, int(sched.ii))
    return x


def emitted(sched: Schedule, t: np.ndarray, o: int) -> np.ndarray:
    """Timestamps of output o: step time + latency, in order (no token overtakes)."""
    return emit_times(t, sched.lat, sched.emit[o])


def emitted_all(sched: Schedule, t: np.ndarray) -> list:
    """Every output's timestamps; the outputs emitted at every step share one array (they are
    only read from here on)."""
    every = None
    out = []
    for o, emit in enumerate(sched.emit):
        if emit is None:
            every = emitted(sched, t, o) if every is None else every
            out.append(every)
        else:
            out.append(emitted(sched, t, o))
    return out


def finish_of(sched: Schedule, t: np.ndarray, outs: list) -> int:
    """When the primitive's last step has left its pipeline (its outputs are cummaxes of
    step times plus latencies, so none is later)."""
    if isinstance(sched.lat, np.ndarray):
        return int(np.max(t + sched.lat))
    return int(t[-1] + sched.lat)


# ---------------------------------------------------------------- one region

ENGINES = ("fast", "stepped", "reference")


@dataclass
class Traced:
    """A region's schedules and streams' lengths, kept for the stepping engines (bounded
    channels: stepped.py; the Python reference: cycle_engine.py)."""

    df: Dataflow
    scheds: dict
    lengths: dict
    counters: dict


def run_region(df: Dataflow, env: dict, timing: Timing, engine: str = "fast", progress=None,
               chunk_tokens: int | None = CHUNK_TOKENS) -> RegionResult:
    """Simulate one region on `env` (updated with its outputs). With the fast engine and unbounded
    channels, a region of more than `chunk_tokens` tokens runs in chunks of its outermost loop
    (chunked.py; None: always whole)."""
    start = time.perf_counter()
    if engine not in ENGINES:
        raise ValueError(f"unknown simulation engine {engine!r}; known: {', '.join(ENGINES)}")
    keep_all = engine != "fast" or timing.channel_depth is not None
    if not keep_all and chunk_tokens:
        done = run_in_chunks(df, env, timing, int(chunk_tokens), _chunk_progress(df, progress))
        if done is not None:
            return chunked_region_result(*done, start)
    ctx = Context.of(df, timing)
    uses: dict[int, int] = {}
    for p in df.prims:
        for s in p.ins:
            uses[s] = uses.get(s, 0) + 1
    keep = {o.stream for o in df.outputs}
    vals: dict = {}
    times: dict = {}
    traced = Traced(df, {}, ctx.lengths, {})
    finish: dict = {}
    for p in df.prims:
        args = [vals[s] for s in p.ins]
        outs = FUNCS[p.kind](p, args, env)
        for s, o in zip(p.outs, outs):
            vals[s] = o
            ctx.lengths[s] = len(o) if isinstance(o, Stream) else len(args[-1]) if p.kind in ("spacc", "buffer") else 1
        sched = schedule(p, args, outs, timing, ctx)
        traced.counters[p.id] = count(p, args, outs, ctx, timing.crd_bytes, timing.value_bytes)
        if keep_all:
            traced.scheds[p.id] = sched
        else:
            t = fire(sched, ready(sched, [times[s] for s in p.ins]))
            es = emitted_all(sched, t)
            times.update(zip(p.outs, es))
            finish[p.id] = (sched.n, finish_of(sched, t, es))
        for s in p.ins:
            uses[s] -= 1
            if uses[s] == 0 and s not in keep:
                del vals[s]
                times.pop(s, None)
        if progress is not None:
            progress(p, outs)
    env.update({o.name: vals[o.stream] for o in df.outputs})
    if keep_all:
        if engine in ("fast", "stepped"):
            finish = run_stepped(traced, timing.channel_depth)
        else:
            from .cycle_engine import run_reference

            finish = run_reference(traced, timing.channel_depth)
    prims = tuple(PrimResult(str(p), p.kind, finish[p.id][0], finish[p.id][1], traced.counters[p.id])
                  for p in df.prims)
    cycles = max((r.finish for r in prims), default=0)
    return RegionResult(df.region, cycles, total(r.counters for r in prims), prims, time.perf_counter() - start)


def _chunk_progress(df: Dataflow, progress):
    """A chunked run reports the fraction of outer coordinates done as primitives' ticks."""
    if progress is None:
        return None
    state = {"ticked": 0}

    def tick(fraction: float) -> None:
        target = int(fraction * len(df.prims))
        for p in df.prims[state["ticked"]:target]:
            progress(p, ())
        state["ticked"] = max(state["ticked"], target)
    return tick


# ---------------------------------------------------------------- programs

def simulate(prog, env: dict, engine: str = "fast", progress: bool = False, chunk_tokens: int | None = CHUNK_TOKENS,
             **timing) -> SimResult:
    """Run every region of `prog` on `env` (updated in place, as a call does) and time it. Regions
    of more than `chunk_tokens` tokens run in chunks of their outermost loop (run_region)."""
    from .target import CompiledRegion

    tm = timing.pop("timing", None) or Timing.make(**timing)
    start = time.perf_counter()
    regions = []
    dfs = [c.dataflow for c in prog._compiled if isinstance(c, CompiledRegion)]
    with _progress(progress, dfs) as tick:
        for c in prog._compiled:
            if isinstance(c, CompiledRegion):
                regions.append(run_region(c.dataflow, env, tm, engine, tick, chunk_tokens))
            else:
                c(env)
    outputs = _outputs(prog, env)
    return SimResult(outputs, sum(r.cycles for r in regions), tuple(regions), total(r.counters for r in regions),
                     tm, time.perf_counter() - start)


def _outputs(prog, env):
    """The outputs as the program's call returns them (Program.outputs_of), else by graph name."""
    outputs_of = getattr(prog, "outputs_of", None)
    return outputs_of(env) if outputs_of else {name: env[name] for name in prog.graph.outputs}


class _progress:
    """A rich progress bar over primitives when asked (the CLI on long runs)."""

    def __init__(self, enabled, dfs):
        self.enabled = enabled
        self.total = sum(len(df.prims) for df in dfs)

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.progress import Progress

        self.bar = Progress(transient=True)
        self.bar.__enter__()
        task = self.bar.add_task("simulating", total=self.total)
        return lambda p, outs: self.bar.advance(task)

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)
        return False
