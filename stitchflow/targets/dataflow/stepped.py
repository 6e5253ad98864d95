"""Bounded channels in the fast engine: the local-clock stepping of cycle_engine.py, compiled.

With backpressure a producer's times depend on its consumers', so the closed forms of
simulate.py no longer apply by themselves. This engine fires steps exactly as the reference
does (a step fires at max(previous step + interval, its input tokens' stamps, the times its
consumers freed the slots it fills), visiting primitives in rounds), but over flat int64
arrays in one numba loop, so its cost is a few tens of nanoseconds per step whatever the
channel depth, and a deadlock shows as a round in which nothing fires.

Unbounded (depth 0) it computes the closed forms' schedule too, which is how the tests check
it against simulate.py's recurrences on graphs too large for the Python reference.
"""

from __future__ import annotations

import numpy as np

from .kernels import njit


def run_stepped(traced, depth: int | None) -> dict:
    """prim id -> (steps, finish) for the region in `traced` (see simulate.Traced)."""
    from .simulate import Deadlock

    flat = _flatten(traced)
    finish, steps, ok = _run(*flat, depth or 0)
    prims = traced.df.prims
    if not ok:
        stuck = [str(p) for p, s, q in zip(prims, steps, flat[0]) if s < q][:3]
        raise Deadlock(f"region {traced.df.region}: channels of depth {depth} deadlock ({'; '.join(stuck)})")
    return {p.id: (int(n), int(f)) for p, n, f in zip(prims, flat[0], finish)}


def _as_steps(x, n: int) -> np.ndarray:
    return np.asarray(x, np.int64) if isinstance(x, np.ndarray) else np.full(n, int(x), np.int64)


class _Pool:
    """Optional int64 arrays packed end to end: add() gives an array's offset (-1 for None,
    the identity), array() the packed whole."""

    def __init__(self):
        self.parts: list = []
        self.size = 0

    def add(self, arr) -> int:
        if arr is None:
            return -1
        self.parts.append(np.asarray(arr, np.int64))
        self.size += len(self.parts[-1])
        return self.size - len(self.parts[-1])

    def array(self) -> np.ndarray:
        return np.concatenate(self.parts + [np.zeros(0, np.int64)])


def _offsets(sizes) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(np.asarray(sizes, np.int64)))).astype(np.int64)


def _flatten(traced):
    """Everything the loop needs as flat arrays with offsets: per primitive its steps, start,
    intervals and latencies; per input slot the stream, its need (-1: identity) and, for a
    channel, its dequeue record; per output the stream and emit (-1: identity); per stream its
    stamps and the dequeue records of its consumers."""
    df, scheds, lengths = traced.df, traced.scheds, traced.lengths
    sid = {s: k for k, s in enumerate(s for p in df.prims for s in p.outs)}
    s_len = np.array([lengths[s] for s in sid], np.int64)
    n = np.array([scheds[p.id].n for p in df.prims], np.int64)
    start = np.array([int(scheds[p.id].start) for p in df.prims], np.int64)
    ii, lat = _Pool(), _Pool()
    for p in df.prims:
        ii.add(_as_steps(scheds[p.id].ii, scheds[p.id].n))
        lat.add(_as_steps(scheds[p.id].lat, scheds[p.id].n))
    in_ptr, in_stream, in_need, in_taken, needs = [0], [], [], [], _Pool()
    taken_len, cons_of = [], {}
    for p in df.prims:
        sc = scheds[p.id]
        for s, nd, channel in zip(p.ins, sc.need, sc.channel):
            in_stream.append(sid[s])
            in_need.append(needs.add(nd))
            in_taken.append(len(taken_len) if channel else -1)
            if channel:
                cons_of.setdefault(sid[s], []).append(len(taken_len))
                taken_len.append(lengths[s])
        in_ptr.append(len(in_stream))
    out_ptr, out_stream, out_emit, emits = [0], [], [], _Pool()
    for p in df.prims:
        for s, e in zip(p.outs, scheds[p.id].emit):
            out_stream.append(sid[s])
            out_emit.append(emits.add(e))
        out_ptr.append(len(out_stream))
    consumers = [cons_of.get(k, ()) for k in range(len(sid))]
    cons = np.array([c for cs in consumers for c in cs], np.int64)
    i64 = lambda xs: np.array(xs, np.int64)  # noqa: E731
    return (n, start, _offsets(n), ii.array(), lat.array(), i64(in_ptr), i64(in_stream), i64(in_need),
            i64(in_taken), needs.array(), i64(out_ptr), i64(out_stream), i64(out_emit), emits.array(), s_len,
            _offsets(s_len), _offsets([len(cs) for cs in consumers]), cons, _offsets(taken_len))


@njit(cache=True, nogil=True)
def _run(n, start, step_off, ii, lat, in_ptr, in_stream, in_need, in_taken, needs, out_ptr, out_stream,
         out_emit, emits, s_len, s_off, cons_ptr, cons, taken_off, depth):
    P = len(n)
    step = np.zeros(P, np.int64)
    last = np.zeros(P, np.int64)
    finish = np.zeros(P, np.int64)
    stamps = np.zeros(s_off[-1], np.int64)
    produced = np.zeros(len(s_len), np.int64)
    taken = np.zeros(taken_off[-1], np.int64)
    taken_n = np.zeros(len(taken_off) - 1, np.int64)
    next_tok = np.zeros(len(out_stream), np.int64)
    left = 0
    for p in range(P):
        if n[p] > 0:
            left += 1
    while left > 0:
        moved = False
        for p in range(P):
            while step[p] < n[p]:
                t = _ready_time(p, step[p], start, last, step_off, ii, in_ptr, in_stream, in_need, needs,
                                stamps, s_off, produced)
                if t < 0:
                    break
                if depth > 0:
                    t = _room_time(p, step[p], t, out_ptr, out_stream, out_emit, emits, s_len, next_tok,
                                   cons_ptr, cons, taken, taken_off, taken_n, depth)
                    if t < 0:
                        break
                _fire(p, step[p], t, step_off, lat, in_ptr, in_need, in_taken, needs, taken, taken_off, taken_n,
                      out_ptr, out_stream, out_emit, emits, s_len, s_off, stamps, produced, next_tok, finish)
                last[p] = t
                step[p] += 1
                moved = True
                if step[p] == n[p]:
                    left -= 1
        if not moved:
            return finish, step, False
    return finish, step, True


@njit(cache=True, nogil=True)
def _need(i, s, in_need, needs):
    return s if in_need[i] < 0 else needs[in_need[i] + s]


@njit(cache=True, nogil=True)
def _ready_time(p, s, start, last, step_off, ii, in_ptr, in_stream, in_need, needs, stamps, s_off, produced):
    """When step s of p may fire as far as its inputs go; -1 if a token is not produced yet."""
    t = start[p] if s == 0 else last[p] + ii[step_off[p] + s - 1]
    for i in range(in_ptr[p], in_ptr[p + 1]):
        j = _need(i, s, in_need, needs)
        if j < 0:
            continue
        q = in_stream[i]
        if produced[q] <= j:
            return -1
        v = stamps[s_off[q] + j]
        if v > t:
            t = v
    return t


@njit(cache=True, nogil=True)
def _room_time(p, s, t, out_ptr, out_stream, out_emit, emits, s_len, next_tok, cons_ptr, cons, taken, taken_off,
               taken_n, depth):
    """Later of t and when every token step s emits has room (its consumers dequeued the
    token `depth` places before it); -1 if one has not yet."""
    for o in range(out_ptr[p], out_ptr[p + 1]):
        q = out_stream[o]
        k = next_tok[o]
        while k < s_len[q] and (k if out_emit[o] < 0 else emits[out_emit[o] + k]) == s:
            if k >= depth:
                for c in cons[cons_ptr[q]:cons_ptr[q + 1]]:
                    if taken_n[c] <= k - depth:
                        return -1
                    v = taken[taken_off[c] + k - depth]
                    if v > t:
                        t = v
            k += 1
    return t


@njit(cache=True, nogil=True)
def _fire(p, s, t, step_off, lat, in_ptr, in_need, in_taken, needs, taken, taken_off, taken_n, out_ptr, out_stream,
          out_emit, emits, s_len, s_off, stamps, produced, next_tok, finish):
    for i in range(in_ptr[p], in_ptr[p + 1]):
        c = in_taken[i]
        if c < 0:
            continue
        j = _need(i, s, in_need, needs)
        while taken_n[c] <= j:
            taken[taken_off[c] + taken_n[c]] = t
            taken_n[c] += 1
    out_t = t + lat[step_off[p] + s]
    if out_t > finish[p]:
        finish[p] = out_t
    for o in range(out_ptr[p], out_ptr[p + 1]):
        q = out_stream[o]
        k = next_tok[o]
        while k < s_len[q] and (k if out_emit[o] < 0 else emits[out_emit[o] + k]) == s:
            v = out_t
            if produced[q] > 0 and stamps[s_off[q] + produced[q] - 1] > v:
                v = stamps[s_off[q] + produced[q] - 1]
            stamps[s_off[q] + produced[q]] = v
            produced[q] += 1
            if v > finish[p]:
                finish[p] = v
            k += 1
        next_tok[o] = k
