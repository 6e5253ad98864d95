"""The simulator's compiled loops (kernels.py) against the numpy formulas they replaced, on
random well-formed streams (scans of random fibertrees, with N tokens as a union makes them)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stitchflow.targets.dataflow import kernels
from stitchflow.targets.dataflow import storage as S
from stitchflow.targets.dataflow.execute import read, repeat, scan
from stitchflow.targets.dataflow.stream import DONE, ELEM, EMPTY, STOP, Stream, root

# ---------------------------------------------------------------- numpy oracles


def np_units(kind):
    item = (kind == ELEM) | (kind == EMPTY)
    prev_item = np.concatenate(([False], item[:-1]))
    return np.flatnonzero(item | ((kind == STOP) & ~prev_item))


def np_unit_of(kind):
    stops = (kind == STOP).astype(np.int64)
    return np.cumsum(stops) - stops


def np_parent_dep(parent, child, peek):
    u = np_units(parent.kind)
    dep = u[np.minimum(np_unit_of(child.kind), len(u) - 1)]
    if peek:
        nxt = np.minimum(dep + 1, len(parent) - 1)
        item = (parent.kind == ELEM) | (parent.kind == EMPTY)
        dep = np.where((child.kind == STOP) & item[dep] & (parent.kind[nxt] == STOP), nxt, dep)
    dep[child.kind == DONE] = len(parent) - 1
    return dep


def np_scan(refs, level):
    k = refs.kind
    n = len(k)
    elem, empty, stop = k == ELEM, k == EMPTY, k == STOP
    item = elem | empty
    prev_item = np.concatenate(([False], item[:-1]))
    next_kind = np.concatenate((k[1:], [DONE]))
    next_ival = np.concatenate((refs.ival[1:], [0]))
    r = np.where(elem, refs.ival, 0)
    if level.kind == S.DENSE:
        start, length = r * level.size, np.where(elem, level.size, 0)
    else:
        start = level.seg[np.minimum(r, len(level.seg) - 2)]
        length = np.where(elem, level.seg[np.minimum(r + 1, len(level.seg) - 1)] - start, 0)
    n_items = np.where(elem, length, np.where(empty, 1, 0))
    n_tail = (item | (stop & ~prev_item) | (k == DONE)).astype(np.int64)
    total = n_items + n_tail
    begin = np.cumsum(total) - total
    kind, cval, rval = (np.empty(int(total.sum()), t) for t in (np.int8, np.int64, np.int64))
    src = np.repeat(np.arange(n), n_items)
    off = np.arange(len(src)) - np.repeat(np.cumsum(n_items) - n_items, n_items)
    pos = np.repeat(begin, n_items) + off
    is_n = empty[src]
    kind[pos] = np.where(is_n, EMPTY, ELEM)
    at = np.where(is_n, 0, start[src] + off)
    if level.kind == S.DENSE:
        cval[pos], rval[pos] = np.where(is_n, 0, off), at
    else:
        cval[pos], rval[pos] = np.where(is_n, 0, level.crd[at] if len(level.crd) else 0), at
    tail = np.flatnonzero(n_tail)
    tpos = begin[tail] + n_items[tail]
    tk = k[tail]
    merged = (tk != STOP) & (tk != DONE) & (next_kind[tail] == STOP)
    lvl = np.where(tk == STOP, refs.ival[tail] + 1, np.where(merged, next_ival[tail] + 1, 0))
    kind[tpos] = np.where(tk == DONE, DONE, STOP)
    cval[tpos] = rval[tpos] = np.where(tk == DONE, 0, lvl)
    return kind, cval, rval


# ---------------------------------------------------------------- random streams


@st.composite
def fibertrees(draw):
    """A random 1-3 level fibertree (dense or compressed levels, empty fibers) and the ref
    streams of scanning it level by level, some elements turned into N."""
    depth = draw(st.integers(1, 3))
    levels, fibers = [], 1
    for _ in range(depth):
        size = draw(st.integers(1, 5))
        if draw(st.booleans()):
            levels.append(S.LevelData(S.DENSE, size))
            fibers *= size
        else:
            lens = draw(st.lists(st.integers(0, size), min_size=fibers, max_size=fibers))
            seg = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
            crd = np.concatenate([np.sort(np.random.default_rng(len(lens) + k).choice(size, m, replace=False))
                                  for k, m in enumerate(lens)] + [np.zeros(0, np.int64)]).astype(np.int64)
            levels.append(S.LevelData(S.COMPRESSED, size, seg, crd))
            fibers = int(seg[-1])
    refs = [root()]
    for level in levels:
        r = refs[-1]
        empties = draw(st.lists(st.booleans(), min_size=len(r), max_size=len(r)))
        kind = np.where((r.kind == ELEM) & np.array(empties, bool) & (np.arange(len(r)) % 3 == 1), EMPTY, r.kind)
        refs[-1] = Stream(kind.astype(np.int8), np.where(kind == EMPTY, 0, r.ival))
        refs.append(scan(refs[-1], level)[1])
    return levels, refs


@settings(max_examples=150, deadline=None)
@given(fibertrees())
def test_scan_and_structure_match_numpy(tree):
    levels, refs = tree
    for parent, level in zip(refs[:-1], levels):
        got = kernels.scan_level(parent.kind, parent.ival, level.kind == S.DENSE, level.size,
                                 level.seg if level.seg is not None else np.zeros(0, np.int64),
                                 level.crd if level.crd is not None else np.zeros(0, np.int64))
        for a, b in zip(got, np_scan(parent, level)):
            np.testing.assert_array_equal(a, b)
    for parent, child in zip(refs[:-1], refs[1:]):
        np.testing.assert_array_equal(kernels.units(parent.kind), np_units(parent.kind))
        np.testing.assert_array_equal(kernels.unit_of(child.kind), np_unit_of(child.kind))
        u = np_units(parent.kind)
        if len(u):
            for peek in (True, False):
                np.testing.assert_array_equal(kernels.parent_dep(parent.kind, u, child.kind, peek),
                                              np_parent_dep(parent, child, peek))
        rep = repeat(parent, child)  # x's items over sig's fibers, against the formula
        items = (child.kind == ELEM) | (child.kind == EMPTY)
        src = u[np.minimum(np_unit_of(child.kind)[items], max(len(u) - 1, 0))]
        np.testing.assert_array_equal(rep.kind[items], parent.kind[src])
        np.testing.assert_array_equal(rep.ival[items], parent.ival[src])


@settings(max_examples=100, deadline=None)
@given(fibertrees())
def test_read_matches_numpy(tree):
    levels, refs = tree
    values = np.random.default_rng(0).standard_normal(max(1, int(refs[-1].ival.max(initial=0)) + 1))
    st_ = S.Storage(tuple(levels), values)
    got = read(st_, refs[-1])
    elem = refs[-1].kind == ELEM
    want = np.zeros(len(refs[-1]))
    want[elem] = values[refs[-1].ival[elem]]
    np.testing.assert_array_equal(got.fval, want)
    np.testing.assert_array_equal(got.kind, np.where(refs[-1].kind == EMPTY, ELEM, refs[-1].kind))


sorted_keys = st.lists(st.integers(0, 40), max_size=30).map(lambda v: np.array(sorted(v), np.int64))


@settings(max_examples=200, deadline=None)
@given(st.lists(sorted_keys, min_size=1, max_size=5))
def test_merge_matches_unique_and_searchsorted(arrays):
    offsets = np.cumsum([0] + [len(a) for a in arrays]).astype(np.int64)
    allk, pos = kernels.merge_sorted(np.concatenate(arrays), offsets)
    want = np.unique(np.concatenate(arrays))
    np.testing.assert_array_equal(allk, want)
    for a, (lo, hi) in zip(arrays, zip(offsets[:-1], offsets[1:])):
        np.testing.assert_array_equal(pos[lo:hi], np.searchsorted(want, a))
        np.testing.assert_array_equal(kernels.need_from_positions(pos[lo:hi], len(want)),
                                      np.searchsorted(a, want, side="right") - 1)


def test_merge_refuses_unsorted_keys():
    import pytest

    with pytest.raises(ValueError, match="not sorted"):
        kernels.merge_sorted(np.array([0, 3, 1], np.int64), np.array([0, 3], np.int64))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=40), st.integers(1, 4),
       st.lists(st.integers(1, 5), min_size=40, max_size=40), st.lists(st.integers(0, 6), min_size=40, max_size=40))
def test_recurrences_match_closed_form(x, ii, iis, lats):
    """fire/emit against the closed form T = C + cummax(X - C) and cummax(T + lat)."""
    x = np.array(x, np.int64)
    c = np.arange(len(x), dtype=np.int64) * ii
    t = x.copy()
    kernels.fire_scalar(t, ii)
    np.testing.assert_array_equal(t, c + np.maximum.accumulate(x - c))
    iia = np.array(iis[: len(x)], np.int64)
    ca = np.concatenate(([0], np.cumsum(iia[:-1])))
    t = x.copy()
    kernels.fire_array(t, iia)
    np.testing.assert_array_equal(t, ca + np.maximum.accumulate(x - ca))
    lat = np.array(lats[: len(x)], np.int64)
    emit = np.flatnonzero(np.arange(len(x)) % 2 == 0)
    np.testing.assert_array_equal(kernels.emit_times(t, lat, emit), np.maximum.accumulate((t + lat)[emit]))
    np.testing.assert_array_equal(kernels.emit_times(t, 3, None), t + 3)
    need = np.maximum.accumulate(np.array([v % (len(x) + 1) - 1 for v in iis[: len(x)]], np.int64))
    got = np.zeros(len(x), np.int64)
    kernels.ready_gather(got, t, need)
    np.testing.assert_array_equal(got, np.where(need >= 0, t[np.maximum(need, 0)], 0))
