"""Cycle-level simulation of compiled dataflow programs (issue 4), fast engine.

Every primitive is run functionally (execute.FUNCS, whole streams as numpy arrays) in the
graph's topological order; right after, its schedule (timing.py) turns its input streams'
timestamps into its own in closed form, a few numpy passes over its tokens (region_run.py).
A region too large to hold whole runs in chunks of its outermost loop (chunked.py).

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

from ...ir.errors import StitchflowError
from .chunked import CHUNK_TOKENS, run_in_chunks
from .counters import Counters, total
from .graph import Dataflow
from .region_run import RegionRun, uses_of
from .stepped import run_stepped
from .timing import Timing


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
    stepping = engine != "fast" or timing.channel_depth is not None
    if not stepping and chunk_tokens:
        done = run_in_chunks(df, env, timing, int(chunk_tokens), _chunk_progress(df, progress))
        if done is not None:
            return _region_result(*done, start)
    run = RegionRun(df, env, timing, keep_schedules=stepping)
    keep = {o.stream for o in df.outputs}
    vals: dict = {}
    run.run_prims(df.prims, vals, {}, uses_of(df.prims), keep, progress=progress)
    env.update({o.name: vals[o.stream] for o in df.outputs})
    if stepping:
        traced = Traced(df, run.schedules, run.ctx.lengths, run.counters)
        if engine in ("fast", "stepped"):
            finish = run_stepped(traced, timing.channel_depth)
        else:
            from .cycle_engine import run_reference

            finish = run_reference(traced, timing.channel_depth)
        run.steps = {i: n for i, (n, _) in finish.items()}
        run.finish = {i: f for i, (_, f) in finish.items()}
    return _region_result(run, 1, start)


def _region_result(run: RegionRun, chunks: int, started: float) -> RegionResult:
    prims = tuple(PrimResult(str(p), p.kind, run.steps.get(p.id, 0), run.finish.get(p.id, 0), run.counters[p.id])
                  for p in run.df.prims)
    cycles = max((r.finish for r in prims), default=0)
    return RegionResult(run.df.region, cycles, total(r.counters for r in prims), prims,
                        time.perf_counter() - started, chunks)


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
    dead = dead_after(prog)
    with _progress(progress, dfs) as tick:
        for k, c in enumerate(prog._compiled):
            if isinstance(c, CompiledRegion):
                regions.append(run_region(c.dataflow, env, tm, engine, tick, chunk_tokens))
            else:
                c(env)
            for name in dead[k]:
                env.pop(name, None)
    outputs = _outputs(prog, env)
    return SimResult(outputs, sum(r.cycles for r in regions), tuple(regions), total(r.counters for r in regions),
                     tm, time.perf_counter() - start)


def dead_after(prog) -> list[set]:
    """Per compiled step, the regions' results that no later step reads and the program does not
    return: simulate drops them from env once that step is done (GraphSAGE's class layer on
    ogbn-mag kept three such 736,389 x 349 tensors, 3 GB, while its last regions ran). A step that
    is not a dataflow region may read anything: nothing made before it dies before it."""
    from .target import CompiledRegion

    graph = prog.graph
    returned = set(graph.outputs) | _leaf_names(getattr(getattr(prog, "captured", None), "out_spec", None))
    last: dict[str, int] = {}  # a region's result -> the last step that makes or reads it
    for k, c in enumerate(prog._compiled):
        if not isinstance(c, CompiledRegion):
            last = {name: len(prog._compiled) for name in last}  # kept to the end
            continue
        for n in c.region.nodes:
            for name in graph.node_of[n].inputs:
                if name in last:
                    last[name] = max(last[name], k)
        last.update({o.name: k for o in c.dataflow.outputs})
    dead: list[set] = [set() for _ in prog._compiled]
    for name, k in last.items():
        if name not in returned and k < len(dead):
            dead[k].add(name)
    return dead


def _leaf_names(out_spec) -> set:
    """The names the program's outputs are rebuilt from (frontend.capture.rebuild_outputs)."""
    if not out_spec:
        return set()
    return {o if isinstance(o, str) else o[0] for o in out_spec[1] if isinstance(o, (str, tuple))}


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
