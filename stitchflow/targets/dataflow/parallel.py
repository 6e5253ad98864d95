"""Parallel lanes: after a level's join, `fork` deals that level's items round-robin to P lanes
(stops and done copied to every lane); each lane runs its own copy of the rest of the walk;
`join_lanes` merges the lanes' result streams back fiber by fiber, in the original order.

Merging a stream that lies m levels below the forked level: its stops of level >= m-1 close
the subtree of one forked unit (an item, or an empty fiber's bare stop), so each lane's stream
cuts into one segment per unit; the merged stream takes the segments in the original unit
order and re-levels each segment's last stop from the merged forked-level stream.
"""

from __future__ import annotations

import numpy as np

from .stream import DONE, STOP, Stream, is_item, item_ordinal, merge_items, units


def parallel_walk(low, expr, levels, idx, rvars, op, st, c_v: int, lanes: int):
    from .lower import Result, State

    v = levels[idx]
    names = list(st.refs)
    forks = {s: low.b.add("fork", (s,), [low.b.streams[s].kind] * lanes, (("lanes", lanes),),
                          label=f"{v} x{lanes}", depth=st.depth)
             for s in dict.fromkeys([st.refs[n] for n in names] + [c_v])}
    outer_lane = low.b.lane
    results = []
    for p in range(lanes):
        low.b.lane = outer_lane + (p,)
        lane_state = State({n: forks[st.refs[n]][p] for n in names}, forks[c_v][p], st.depth)
        results.append(low.walk(expr, levels, idx + 1, rvars, op, lane_state, top=True))
    low.b.lane = outer_lane
    lane_cv = tuple(forks[c_v][p] for p in range(lanes))
    merged_cv = low.b.one("join_lanes", lane_cv, ["crd"], (("lanes", lanes), ("below", 0)),
                          label=f"{v} x{lanes}", depth=st.depth)
    first = results[0]
    crds = []
    for k in range(len(first.levels)):
        ins = (merged_cv,) + lane_cv + tuple(r.crds[k] for r in results)
        crds.append(low.b.one("join_lanes", ins, ["crd"], (("lanes", lanes), ("below", k + 1)),
                              label=f"{first.levels[k]} x{lanes}", depth=st.depth + first.levels[: k + 1]))
    ins = (merged_cv,) + lane_cv + tuple(r.values for r in results)
    vals = low.b.one("join_lanes", ins, ["val"], (("lanes", lanes), ("below", len(first.levels))),
                     label=f"values x{lanes}", depth=st.depth + first.levels)
    return Result((v,) + first.levels, (merged_cv,) + tuple(crds), vals, first.axes)


# ---------------------------------------------------------------- functional semantics

def fork(s: Stream, lanes: int) -> tuple[Stream, ...]:
    item = is_item(s)
    lane_of = item_ordinal(s) % lanes
    out = []
    for p in range(lanes):
        keep = ~item | (lane_of == p)
        out.append(Stream(s.kind[keep], s.ival[keep], None if s.fval is None else s.fval[keep]))
    return tuple(out)


def join_forked(lane_streams: list[Stream]) -> Stream:
    """The forked level itself: items back in round-robin order, stops from lane 0."""
    lanes = len(lane_streams)
    per_lane = [np.flatnonzero(is_item(s)) for s in lane_streams]
    n = sum(len(x) for x in per_lane)
    src_lane = np.arange(n) % lanes
    src_pos = np.empty(n, np.int64)
    unit = np.empty(n, np.int64)
    for p, s in enumerate(lane_streams):
        mine = src_lane == p
        src_pos[mine] = per_lane[p][: int(mine.sum())]
        stops = (s.kind == STOP).astype(np.int64)
        unit[mine] = (np.cumsum(stops) - stops)[src_pos[mine]]
    items = {"kind": np.empty(n, np.int8), "ival": np.empty(n, np.int64)}
    fval = None if lane_streams[0].fval is None else np.empty((n,) + lane_streams[0].fval.shape[1:])
    for p, s in enumerate(lane_streams):
        mine = src_lane == p
        items["kind"][mine] = s.kind[src_pos[mine]]
        items["ival"][mine] = s.ival[src_pos[mine]]
        if fval is not None:
            fval[mine] = s.fval[src_pos[mine]]
    items["fval"] = fval
    return merge_items(unit, lane_streams[0], items)


def join_below(merged: Stream, lane_cv: list[Stream], lane_streams: list[Stream], below: int) -> Stream:
    """A stream `below` levels under the forked level, merged back in the original order."""
    lanes = len(lane_cv)
    segs = []  # per lane: (segment start, segment end) per unit, and the unit's item ordinal
    for cv, s in zip(lane_cv, lane_streams):
        u = units(cv)
        bounds = np.flatnonzero((s.kind == STOP) & (s.ival >= below - 1))
        if len(bounds) != len(u):
            raise ValueError(f"join_lanes: {len(bounds)} segments for {len(u)} units")
        starts = np.concatenate(([0], bounds[:-1] + 1))
        item_units = np.flatnonzero(is_item(cv)[u])
        segs.append((starts, bounds, item_units))
    mu = units(merged)
    m_item = is_item(merged)[mu]
    nxt = np.concatenate((merged.kind[1:], [DONE]))[mu]
    nxt_lvl = np.concatenate((merged.ival[1:], [0]))[mu]
    level = np.where(m_item, np.where(nxt == STOP, below + nxt_lvl, below - 1), below + merged.ival[mu])
    g = np.cumsum(m_item) - m_item  # global item ordinal of each merged unit
    lane = np.where(m_item, g % lanes, 0)
    local = g // lanes
    starts = np.zeros(len(mu), np.int64)
    ends = np.zeros(len(mu), np.int64)
    offset = np.zeros(len(mu), np.int64)
    base = np.cumsum([0] + [len(s) for s in lane_streams])
    for p in range(lanes):
        mine = m_item & (lane == p)
        st_, en_, iu = segs[p]
        starts[mine] = st_[iu[local[mine]]]
        ends[mine] = en_[iu[local[mine]]]
        offset[mine] = base[p]
    length = np.where(m_item, ends - starts + 1, 1)
    kind_all = np.concatenate([s.kind for s in lane_streams])
    ival_all = np.concatenate([s.ival for s in lane_streams])
    fval_all = None if lane_streams[0].fval is None else np.concatenate([s.fval for s in lane_streams])
    first = np.cumsum(length) - length
    tok = np.arange(int(length.sum())) - np.repeat(first, length)
    unit_of_tok = np.repeat(np.arange(len(mu)), length)
    src = offset[unit_of_tok] + starts[unit_of_tok] + tok
    is_bare = ~m_item[unit_of_tok]
    last = tok == length[unit_of_tok] - 1
    kind = np.where(is_bare, STOP, kind_all[np.where(is_bare, 0, src)]).astype(np.int8)
    ival = np.where(is_bare | last, level[unit_of_tok], ival_all[np.where(is_bare, 0, src)])
    kind = np.concatenate((kind, [DONE])).astype(np.int8)
    ival = np.concatenate((ival, [0]))
    fval = None
    if fval_all is not None:
        fval = np.zeros((len(kind),) + fval_all.shape[1:])
        fval[:-1] = np.where(_expand(is_bare, fval_all), 0.0, fval_all[np.where(is_bare, 0, src)])
    return Stream(kind, ival, fval)


def _expand(mask, like):
    return mask.reshape((-1,) + (1,) * (like.ndim - 1))
