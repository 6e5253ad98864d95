"""The fast engine's loop over a region: each primitive is run functionally (execute.FUNCS, whole
streams as numpy arrays) in topological order, and right after, its schedule (timing.py) turns
its input streams' timestamps into its own.

The recurrence T[s] = max(X[s], T[s-1] + ii[s-1]) has the closed form T = C + cummax(X - C),
with C the running sum of the intervals, so a primitive costs a few numpy passes over its
tokens. Streams and timestamps are freed after their last consumer.

One `RegionRun` serves a whole region (simulate.run_region) and a region run in chunks of its
outer loop (chunked.py): a chunk other than the last leaves a carry (when each primitive may
step next, when each stream's last token left) that the next chunk's first steps wait for.
With bounded channels the schedules are only kept (keep_schedules) for stepped.py to fire.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .counters import count
from .execute import FUNCS, write_into
from .graph import Dataflow, Prim
from .kernels import emit_times, fire_array, fire_scalar, ready_gather
from .stream import Stream
from .timing import Context, Schedule, Timing, schedule


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


# ---------------------------------------------------------------- a region's run

def uses_of(prims) -> dict:
    """Stream id -> how many of `prims` read it."""
    uses: dict = {}
    for p in prims:
        for s in p.ins:
            uses[s] = uses.get(s, 0) + 1
    return uses


def release(p: Prim, vals: dict, times: dict, uses: dict, keep: set, persistent=()) -> None:
    """p has read its inputs: free those it was the last to read, unless kept or persistent."""
    for s in p.ins:
        uses[s] -= 1
        if uses[s] == 0 and s not in keep and s not in persistent:
            vals.pop(s, None)
            times.pop(s, None)


# the input whose tokens a writer's or accumulator's steps follow: its innermost coordinates
DOMAIN_OF = {"write": -3, "buffer_write": -3, "spacc": -2, "buffer": -2}


class RegionRun:
    """One region's run: the values and timestamps that live for the whole region, the carry
    from one chunk to the next, and the totals (steps, finish and counters per primitive)."""

    def __init__(self, df: Dataflow, env: dict, timing: Timing | None, stats: dict | None = None,
                 keep_schedules: bool = False):
        self.df, self.env, self.timing, self.stats = df, env, timing, stats
        self.outer = df.order[0] if df.order else None  # of the nest running in chunks (chunked.py)
        self.keep_schedules = keep_schedules
        self.depth = {s.id: s.depth for s in df.streams}
        self.ctx = Context.of(df, timing) if timing is not None else None
        self.vals: dict = {}
        self.times: dict = {}
        self.schedules: dict = {}  # prim id -> Schedule, with keep_schedules (bounded channels)
        self.steps: dict = {}
        self.finish: dict = {}
        self.counters: dict = {}
        self.next_step: dict = {}  # prim id -> earliest time of its next step (a chunk's carry)
        self.last_emit: dict = {}  # stream id -> time its last token left (a chunk's carry)
        self.tokens = 0
        self.final = True  # False while a chunk other than the last runs
        self.into: dict = {}  # writer prim id -> the array its chunks all scatter into (chunked.py)

    def closers(self, sid: int, out) -> int:
        """Tokens a chunk appends to a stream that the whole run has only once, at its end: the
        done, and the outer fiber's stop in a stream of the outer level (deeper streams' last
        stop is the whole run's stop at that place, raised a level)."""
        if not isinstance(out, Stream) or not self.depth.get(sid):
            return 0
        return 2 if self.depth[sid] == (self.outer,) else 1

    def timed_closers(self, p: Prim, k: int, out, args) -> int:
        """The closing timestamps at the end of output k: a stream's closing tokens; an
        accumulator's storages follow its parent's items, closers included."""
        if isinstance(out, Stream):
            return self.closers(p.outs[k], out)
        if p.kind in ("spacc", "buffer"):
            return self.closers(p.ins[-1], args[-1])
        return 0

    def last_real_step(self, p: Prim, outs, args, sched) -> int:
        """The step that emits the primitive's last token of this chunk that the whole run has
        too: the next chunk's first step follows it (not the closers, which may wait longer).
        Writers and accumulators emit no stream: theirs is the step before their innermost
        coordinates' closers."""
        last = -1
        for o, out in enumerate(outs):
            real = len(out) - self.closers(p.outs[o], out) if isinstance(out, Stream) else 0
            if real > 0:
                emit = sched.emit[o]
                last = max(last, int(emit[real - 1]) if emit is not None else real - 1)
        if last >= 0 or len(p.ins) < 3 or p.kind not in DOMAIN_OF:
            return last if last >= 0 else sched.n - 1
        k = DOMAIN_OF[p.kind]
        if len(args[k]) != sched.n:  # a step per token of that stream, or not ours to place
            return sched.n - 1
        return sched.n - 1 - self.closers(p.ins[k], args[k])

    def run_prims(self, prims, vals: dict, times: dict, uses: dict, keep: set, persistent=(), progress=None) -> None:
        """Fire `prims` in order on `vals`/`times` (updated), freeing each stream after its last
        use (`uses`, consumed) unless kept or persistent; `progress(p, outs)` after each."""
        for p in prims:
            outs = self.fire(p, vals, times)
            vals.update(zip(p.outs, outs))
            release(p, vals, times, uses, keep, persistent)
            if progress is not None:
                progress(p, outs)

    def fire(self, p: Prim, vals: dict, times: dict) -> list:
        """Run one primitive on the streams in `vals` and time it from `times` (its outputs'
        timestamps are added there); returns its outputs."""
        args = [vals[s] for s in p.ins]
        if p.id in self.into:
            outs = (write_into(p, args, self.into[p.id]),)
        else:
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
        c = count(p, args, outs, self.ctx, self.timing.crd_bytes, self.timing.value_bytes)
        c = replace(c, tokens=c.tokens - extra) if extra else c
        self.counters[p.id] = c + self.counters[p.id] if p.id in self.counters else c
        self.steps[p.id] = self.steps.get(p.id, 0) + sched.n
        if self.keep_schedules:
            self.schedules[p.id] = sched
        else:
            self._time(p, args, outs, sched, times)
        return outs

    def _time(self, p: Prim, args: list, outs: list, sched: Schedule, times: dict) -> None:
        """Fire the schedule from its inputs' timestamps and the previous chunk's carry."""
        x = ready(sched, [times[s] for s in p.ins])
        if sched.n and p.id in self.next_step:
            x[0] = max(x[0], self.next_step[p.id])
        t = fire(sched, x)
        es = emitted_all(sched, t)
        for s, e in zip(p.outs, es):
            if len(e) and s in self.last_emit:
                e[0] = max(e[0], self.last_emit[s])
                np.maximum.accumulate(e, out=e)
        times.update(zip(p.outs, es))
        if not sched.n:
            return
        self.finish[p.id] = max(self.finish.get(p.id, 0), finish_of(sched, t, es))
        if not self.final:  # the next chunk starts from here
            for k, (s, e) in enumerate(zip(p.outs, es)):
                real = len(e) - self.timed_closers(p, k, outs[k], args)
                if real > 0:
                    self.last_emit[s] = int(e[real - 1])
            last = self.last_real_step(p, outs, args, sched)
            ii = sched.ii[last] if isinstance(sched.ii, np.ndarray) else sched.ii
            self.next_step[p.id] = int(t[last] + ii)
