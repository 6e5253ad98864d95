"""The simulator's hot loops, compiled with numba (one pass over a stream instead of the
several temporaries a numpy expression of the same recurrence makes).

Each function is the plain loop of what its docstring says; `tests/targets/dataflow/
test_kernels.py` checks every one against the numpy formula it replaces. Without numba
(e.g. a GPU box that never simulates) the same loops run as Python: correct, slow.
"""

from __future__ import annotations

import numpy as np

try:
    from numba import njit
except ImportError:  # pragma: no cover - numba is a dependency; this keeps imports working
    def njit(*args, **kwargs):
        if args and callable(args[0]):
            return args[0]
        return lambda f: f


# ---------------------------------------------------------------- schedules and recurrences (timing.py, simulate.py)

@njit(cache=True, nogil=True)
def merge_sorted(flat: np.ndarray, offsets: np.ndarray):
    """Merge the sorted key arrays flat[offsets[i]:offsets[i+1]]: returns the distinct keys in
    order (`allk`, one step per key) and, per element of `flat`, the step of its key.
    Raises ValueError when an array is not sorted (the timing model's keys always are)."""
    m = len(offsets) - 1
    ptr = offsets[:-1].copy()
    allk = np.empty(len(flat), np.int64)
    pos = np.empty(len(flat), np.int64)
    n = 0
    while True:
        found = False
        best = 0
        for i in range(m):
            if ptr[i] < offsets[i + 1]:
                v = flat[ptr[i]]
                if not found or v < best:
                    best = v
                    found = True
        if not found:
            break
        allk[n] = best
        for i in range(m):
            j = ptr[i]
            end = offsets[i + 1]
            while j < end and flat[j] == best:
                pos[j] = n
                j += 1
            if j < end and flat[j] < best:
                raise ValueError("merge_sorted: keys are not sorted")
            ptr[i] = j
        n += 1
    return allk[:n], pos


@njit(cache=True, nogil=True)
def need_from_positions(pos: np.ndarray, n: int) -> np.ndarray:
    """need[s] = the last token of a sorted key array whose key is at or before step s (-1 if
    none), i.e. `searchsorted(keys, allk, side="right") - 1`, from the tokens' steps."""
    need = np.full(n, -1, np.int64)
    for j in range(len(pos)):
        need[pos[j]] = j
    for s in range(1, n):
        if need[s] < need[s - 1]:
            need[s] = need[s - 1]
    return need


@njit(cache=True, nogil=True)
def ready_gather(x: np.ndarray, t: np.ndarray, need: np.ndarray) -> None:
    """x[s] = max(x[s], t[need[s]]) where need[s] >= 0 (the step waits for that token)."""
    for s in range(len(x)):
        j = need[s]
        if j >= 0:
            v = t[j]
            if v > x[s]:
                x[s] = v


@njit(cache=True, nogil=True)
def fire_scalar(x: np.ndarray, ii: int) -> None:
    """In place T[s] = max(X[s], T[s-1] + ii)."""
    for s in range(1, len(x)):
        v = x[s - 1] + ii
        if v > x[s]:
            x[s] = v


@njit(cache=True, nogil=True)
def fire_array(x: np.ndarray, ii: np.ndarray) -> None:
    """In place T[s] = max(X[s], T[s-1] + ii[s-1])."""
    for s in range(1, len(x)):
        v = x[s - 1] + ii[s - 1]
        if v > x[s]:
            x[s] = v


def emit_times(t: np.ndarray, lat, emit) -> np.ndarray:
    """Timestamps of an output: e[k] = T[emit[k]] + lat[emit[k]], kept in order (a token never
    overtakes the one before). `lat` is an int or one per step; `emit` None means the
    identity. T is non-decreasing, so with one latency the order holds by itself."""
    if not isinstance(lat, np.ndarray):
        if emit is None:
            return t if lat == 0 else t + lat
        return t[emit] + lat
    return _emit_in_order(t, lat, np.arange(len(t)) if emit is None else emit)


@njit(cache=True, nogil=True)
def _emit_in_order(t: np.ndarray, lat: np.ndarray, emit: np.ndarray) -> np.ndarray:
    e = np.empty(len(emit), np.int64)
    prev = np.int64(-(1 << 62))
    for k in range(len(emit)):
        s = emit[k]
        v = t[s] + lat[s]
        if v < prev:
            v = prev
        e[k] = v
        prev = v
    return e


# ---------------------------------------------------------------- stream structure and primitives (stream.py, execute.py)
# token kinds, as in stream.py (kept literal here: numba needs compile-time constants)
_ELEM, _STOP, _DONE, _EMPTY = 0, 1, 2, 3


@njit(cache=True, nogil=True)
def units(kind: np.ndarray) -> np.ndarray:
    """Token indices of the units of a stream: items, and stops that follow no item."""
    out = np.empty(len(kind), np.int64)
    n = 0
    prev_item = False
    for t in range(len(kind)):
        k = kind[t]
        item = k == _ELEM or k == _EMPTY
        if item or (k == _STOP and not prev_item):
            out[n] = t
            n += 1
        prev_item = item
    return out[:n]


@njit(cache=True, nogil=True)
def unit_of(kind: np.ndarray) -> np.ndarray:
    """For each token of a child stream, the index of the parent unit it belongs to (how many
    stops precede it)."""
    out = np.empty(len(kind), np.int64)
    c = 0
    for t in range(len(kind)):
        out[t] = c
        if kind[t] == _STOP:
            c += 1
    return out


@njit(cache=True, nogil=True)
def parent_dep(pkind: np.ndarray, u: np.ndarray, ckind: np.ndarray, peek: bool) -> np.ndarray:
    """Per child token, the parent token it needs: the unit that opened its fiber; a stop
    closing a fiber also the parent stop right after that unit when the scanner merges it
    (peek); done the parent's last token. `u` = units(parent), non-empty."""
    n_p = len(pkind)
    dep = np.empty(len(ckind), np.int64)
    c = 0
    last_u = len(u) - 1
    for t in range(len(ckind)):
        k = ckind[t]
        d = u[min(c, last_u)]
        if k == _DONE:
            d = n_p - 1
        elif peek and k == _STOP:
            nxt = min(d + 1, n_p - 1)
            pk = pkind[d]
            if (pk == _ELEM or pk == _EMPTY) and pkind[nxt] == _STOP:
                d = nxt
        dep[t] = d
        if k == _STOP:
            c += 1
    return dep


@njit(cache=True, nogil=True)
def scan_level(kind: np.ndarray, ival: np.ndarray, dense: bool, size: int, seg: np.ndarray,
               crd: np.ndarray):
    """The level scanner over a ref stream (execute.scan): each ref's fiber of the level as
    coordinates and refs, an N for an N, then the stop closing the fiber (absorbing a following
    S(n) as S(n+1)); a bare S(n) becomes S(n+1); D stays D. Returns (kind, crd, ref)."""
    n = len(kind)
    nseg = len(seg)
    total = 0
    for t in range(n):  # pass 1: output length
        k = kind[t]
        if k == _ELEM:
            total += 1 + _fiber(ival[t], dense, size, seg, nseg)[1]
        elif k == _EMPTY or k == _DONE or (k == _STOP and not (t > 0 and _is_item(kind[t - 1]))):
            total += 2 if k == _EMPTY else 1
    okind = np.empty(total, np.int8)
    ocrd = np.empty(total, np.int64)
    oref = np.empty(total, np.int64)
    w = 0
    for t in range(n):
        k = kind[t]
        if k == _ELEM:
            start, length = _fiber(ival[t], dense, size, seg, nseg)
            for off in range(length):
                okind[w] = _ELEM
                ocrd[w] = off if dense else (crd[start + off] if len(crd) else 0)
                oref[w] = start + off
                w += 1
        elif k == _EMPTY:
            okind[w] = _EMPTY
            ocrd[w] = 0
            oref[w] = 0
            w += 1
        elif k == _STOP and t > 0 and _is_item(kind[t - 1]):
            continue  # merged into the stop closing the previous item's fiber
        if k == _DONE:
            okind[w] = _DONE
            ocrd[w] = 0
            oref[w] = 0
        else:
            lvl = ival[t] + 1 if k == _STOP else 0
            if k != _STOP and t + 1 < n and kind[t + 1] == _STOP:
                lvl = ival[t + 1] + 1
            okind[w] = _STOP
            ocrd[w] = lvl
            oref[w] = lvl
        w += 1
    return okind, ocrd, oref


@njit(cache=True, nogil=True)
def _is_item(k) -> bool:
    return k == _ELEM or k == _EMPTY


@njit(cache=True, nogil=True)
def _fiber(r, dense, size, seg, nseg):
    if dense:
        return r * size, size
    if nseg > 1:
        start = seg[min(r, nseg - 2)]
        return start, seg[min(r + 1, nseg - 1)] - start
    return 0, (seg[0] if nseg == 1 else 0)


@njit(cache=True, nogil=True)
def read_values(kind: np.ndarray, ival: np.ndarray, values: np.ndarray):
    """Array read of scalar values (execute.read): an element's ref picks its value, an N
    reads as a zero element, stops keep their level. Returns (kind, ival, fval)."""
    n = len(kind)
    okind = np.empty(n, np.int8)
    oival = np.zeros(n, np.int64)
    fval = np.zeros(n, np.float64)
    for t in range(n):
        k = kind[t]
        if k == _ELEM:
            fval[t] = values[ival[t]]
        if k == _EMPTY:
            k = _ELEM
        okind[t] = k
        if k == _STOP:
            oival[t] = ival[t]
    return okind, oival, fval


@njit(cache=True, nogil=True)
def repeat_tokens(u: np.ndarray, xkind: np.ndarray, xival: np.ndarray, skind: np.ndarray,
                  sival: np.ndarray):
    """repeat (execute.repeat) without values: the signal's structure with each item replaced
    by the unit of x whose fiber it lies in. Returns (kind, ival, src) with src -1 on stops."""
    n = len(skind)
    kind = np.empty(n, np.int8)
    ival = np.zeros(n, np.int64)
    src = np.empty(n, np.int64)
    c = 0
    last_u = len(u) - 1
    for t in range(n):
        k = skind[t]
        if k == _ELEM or k == _EMPTY:
            j = u[min(c, last_u)] if last_u >= 0 else 0
            src[t] = j
            kind[t] = xkind[j]
            ival[t] = xival[j]
        else:
            src[t] = -1
            kind[t] = k
            if k == _STOP:
                ival[t] = sival[t]
                c += 1
    return kind, ival, src


@njit(cache=True, nogil=True)
def gather_values(fval: np.ndarray, src: np.ndarray) -> np.ndarray:
    """out[t] = fval[src[t]] where src[t] >= 0, else 0."""
    out = np.zeros(len(src), np.float64)
    for t in range(len(src)):
        if src[t] >= 0:
            out[t] = fval[src[t]]
    return out
