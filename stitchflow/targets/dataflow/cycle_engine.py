"""The reference engine: primitives with local clocks stepping token by token through plain
Python queues, for small graphs. It checks the fast engine (simulate.py): both read the same
schedules (timing.py), this one by firing one step at a time when its input tokens have been
produced and its output channels have room, the fast one by closed forms over whole arrays.

DAM, the framework FuseFlow's simulator is built on, also gives every primitive its own
clock rather than stepping a global cycle counter: a primitive fires step s at

    max(its previous step + interval, the stamps of the tokens it dequeues,
        for bounded channels the times its consumers freed the slots it fills)

and a token it emits carries that time plus the step's latency. Primitives are visited in
rounds, each advancing while everything its next step waits on is already known, so every
time is final when written; a round in which nobody advances while work is left is a deadlock.
"""

from __future__ import annotations

import numpy as np


def _steps_of(emit, n_tokens: int):
    """For an output: list of (step -> number of tokens it emits) as a per-token step list."""
    return list(range(n_tokens)) if emit is None else emit.tolist()


class _Prim:
    def __init__(self, p, sched, lengths):
        self.p = p
        self.n = sched.n
        self.s = 0
        self.last = None
        self.start = int(sched.start)
        self.ii = sched.ii.tolist() if isinstance(sched.ii, np.ndarray) else [int(sched.ii)] * sched.n
        self.lat = sched.lat.tolist() if isinstance(sched.lat, np.ndarray) else [int(sched.lat)] * sched.n
        self.need = [list(range(sched.n)) if nd is None else nd.tolist() for nd in sched.need]
        self.emit = [_steps_of(e, lengths[s]) for e, s in zip(sched.emit, p.outs)]
        self.next_tok = [0] * len(p.outs)
        self.channel = sched.channel
        self.finish = 0


def run_reference(traced, depth: int | None) -> dict:
    from .simulate import Deadlock

    df, scheds, lengths = traced.df, traced.scheds, traced.lengths
    prims = [_Prim(p, scheds[p.id], lengths) for p in df.prims]
    stamps: dict = {s: [] for p in df.prims for s in p.outs}  # the queue of every stream
    taken: dict = {}  # (consumer, slot) -> dequeue time of each token taken so far
    cons: dict = {}
    for q in prims:
        for slot, s in enumerate(q.p.ins):
            if q.channel[slot]:
                taken[(q.p.id, slot)] = []
                cons.setdefault(s, []).append((q.p.id, slot))
    left = len(prims)
    while left:
        moved = False
        for q in prims:
            while q.s < q.n and _try_fire(q, stamps, taken, cons, depth):
                moved = True
                if q.s == q.n:
                    left -= 1
        if not moved and left:
            stuck = [str(q.p) for q in prims if q.s < q.n][:3]
            raise Deadlock(f"region {df.region}: channels of depth {depth} deadlock ({'; '.join(stuck)})")
    return {q.p.id: (q.n, q.finish) for q in prims}


def _try_fire(q: _Prim, stamps, taken, cons, depth) -> bool:
    s = q.s
    t = q.start if s == 0 else q.last + q.ii[s - 1]
    for slot, sid in enumerate(q.p.ins):
        j = q.need[slot][s]
        if j < 0:
            continue
        queue = stamps[sid]
        if len(queue) <= j:
            return False  # the token has not been produced yet
        t = max(t, queue[j])
    if depth is not None:
        for o, sid in enumerate(q.p.outs):
            k = q.next_tok[o]
            emit = q.emit[o]
            while k < len(emit) and emit[k] == s:
                if k >= depth:
                    for key in cons.get(sid, ()):
                        freed = taken[key]
                        if len(freed) <= k - depth:
                            return False  # no room in that channel yet
                        t = max(t, freed[k - depth])
                k += 1
    # fire step s at t
    for slot, sid in enumerate(q.p.ins):
        if q.channel[slot]:
            got = taken[(q.p.id, slot)]
            j = q.need[slot][s]
            while len(got) <= j:
                got.append(t)
    out_t = t + q.lat[s]
    q.finish = max(q.finish, out_t)
    for o, sid in enumerate(q.p.outs):
        emit, queue = q.emit[o], stamps[sid]
        k = q.next_tok[o]
        while k < len(emit) and emit[k] == s:
            queue.append(max(out_t, queue[-1]) if queue else out_t)
            q.finish = max(q.finish, queue[-1])
            k += 1
        q.next_tok[o] = k
    q.last = t
    q.s += 1
    return True
