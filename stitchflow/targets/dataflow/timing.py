"""The timing model (spec/dataflow.md, "Timing model"): a table of initiation interval and
latency per primitive kind, block-value costs, channel depth and an optional memory model,
and, per primitive, its *schedule*: the "dependency + timing" description both simulation
engines are built on (simulate.py vectorises it, cycle_engine.py steps it token by token).

A schedule cuts a primitive's work into `n` steps (firings of its local clock). Step s
needs the input tokens up to `need[i][s]` of every input i (-1: none; monotone), and emits
the tokens k of output o with `emit[o][k] == s`. Step s fires at

    T[s] = max(T[s-1] + ii[s-1], max_i t_i[need[i][s]], start if s == 0, backpressure)

and emits its tokens at T[s] + lat[s] (kept in order: a token never overtakes the previous
one). `need` / `emit` None mean the identity (one step per token, the common 1:1 case).

Token-level dependencies per kind (why each is what it is):
- 1:1 kinds (alu, read, fill, repsig, iota): step k needs token k of every input.
- scan / range / locate / repeat: a child fiber needs the parent token that opened it; the
  stop closing it also the parent stop right after (the scanner peeks it to merge S(n) into
  S(n+1)); done needs the parent's done.
- join: an n-ary merge advancing the inputs holding the smallest coordinate, one step per
  distinct (fiber, coordinate) among its inputs plus one per stop: intersections pay for the
  coordinates they skip.
- reduce: one step per input value (accumulate), the sum leaves at the fiber's closing stop,
  an S(n-1) one step later. spacc/buffer/writers: one step per value token; outer levels'
  tokens are consumed with the value that closes them.
- fork: one step per input token, each lane gets its own; join_lanes: one step per merged
  token, needing the lane token it came from.
Storage (a region input, or an accumulator's result) is not a channel: an input from memory
is ready at 0, a buffer written in the region when its writer finished, and an accumulator's
fiber when its closing stop has been accumulated (readers through `iota` wait for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from .graph import Prim
from . import kernels
from .kernels import merge_sorted, need_from_positions
from .stream import DONE, ELEM, STOP, Stream, is_item, unit_of, units

MEMORY_KINDS = ("scan", "read", "write")


@dataclass(frozen=True)
class MemoryModel:
    """Memory channels served round-robin: the memory primitives of a region are dealt to
    `channels` channels; a channel serves its clients in turn, so each request of a client
    costs `interval` (per `bytes_per_cycle` moved) times the number of clients sharing it,
    arrives after `latency`, and the first request waits `startup` cycles."""

    channels: int = 8
    latency: int = 64
    interval: int = 1
    startup: int = 100
    bytes_per_cycle: int = 64


@dataclass(frozen=True)
class Timing:
    default_ii: int = 1
    default_latency: int = 1
    ii: tuple[tuple[str, int], ...] = ()  # overrides per primitive kind
    latency: tuple[tuple[str, int], ...] = (("load", 0),)
    tile_elementwise_ii: int = 1  # the spec names only the b^2 latency of tile ALUs
    channel_depth: int | None = None  # None: unbounded channels
    memory: MemoryModel | None = None
    crd_bytes: int = 4
    value_bytes: int = 4

    @classmethod
    def make(cls, channel_depth=None, memory_model=None, ii=None, latency=None, **kw) -> "Timing":
        """From keyword arguments: `memory_model` True, a dict or a MemoryModel; `ii` and
        `latency` dicts of per-kind overrides."""
        mem = memory_model
        if mem is True:
            mem = MemoryModel()
        elif isinstance(mem, dict):
            mem = MemoryModel(**mem)
        elif not mem:
            mem = None
        lat = dict(cls.latency) | dict(latency or {})
        if channel_depth is not None and int(channel_depth) < 1:
            raise ValueError("channel_depth must be at least 1")
        return cls(ii=tuple(sorted((ii or {}).items())), latency=tuple(sorted(lat.items())),
                   channel_depth=None if channel_depth is None else int(channel_depth), memory=mem, **kw)

    def ii_of(self, kind: str) -> int:
        return max(1, dict(self.ii).get(kind, self.default_ii))

    def lat_of(self, kind: str) -> int:
        return max(0, dict(self.latency).get(kind, self.default_latency))


@dataclass(frozen=True, eq=False)
class Schedule:
    n: int
    need: tuple  # per input slot: int64 array (n,) or None (identity)
    emit: tuple  # per output: int64 array (len,) or None (identity)
    ii: object  # int or int64 array (n,)
    lat: object  # int or int64 array (n,)
    start: int = 0
    channel: tuple = ()  # per input slot: True when it is a stream channel (backpressure)
    mem_channel: int = -1


# ---------------------------------------------------------------- helpers

def cummax_need(dep: np.ndarray, n_in: int) -> np.ndarray:
    need = np.maximum.accumulate(dep) if len(dep) else dep
    if len(need):
        need[-1] = n_in - 1  # the last step has consumed everything
    return need


def parent_dep(parent: Stream, child: Stream, peek: bool = True) -> np.ndarray:
    """Per child token, the parent token it needs (see module docstring)."""
    u = units(parent)
    if not len(u):
        return np.full(len(child), len(parent) - 1, np.int64)
    return kernels.parent_dep(parent.kind, u, child.kind, peek)


def closing_keys(parent: Stream, child: Stream, child_keys: np.ndarray) -> np.ndarray:
    """Keys for a parent's tokens given its child's: a unit is consumed with the child stop
    that closes it, a stop following an item with that item, done with the child's done."""
    u = units(parent)
    keys = np.empty(len(parent), np.int64)
    child_stops = np.flatnonzero(child.kind == STOP)
    if len(u) != len(child_stops):
        raise ValueError("timing: child stream does not match its parent")
    keys[u] = child_keys[child_stops]
    rest = np.ones(len(parent), bool)
    rest[u] = False
    idx = np.flatnonzero(rest)
    if len(idx):  # non-unit stops follow an item (its key); done takes the child's done
        prev = np.maximum.accumulate(np.where(~rest, np.arange(len(parent)), -1))
        keys[idx] = np.where(prev[idx] >= 0, keys[np.maximum(prev[idx], 0)], 0)
    keys[parent.kind == DONE] = child_keys[-1]
    return np.maximum.accumulate(keys)


def from_keys(in_keys: list, out_keys: list, domain: int | None = None, identity=None):
    """Steps as the merge of key sequences: one step per distinct key; an input token is
    consumed at the step of its key, an output token emitted at the step of its key.
    `domain` = n when one input's keys are 0..n-1 and the others' lie among them (a chain's
    keys): then the steps are those keys and no merge is needed; `identity` is that input
    (step s takes its token s: need None)."""
    if domain is not None:
        need = [None if k is None or k is identity else need_from_positions(k, domain) for k in in_keys]
        return domain, need, [None if k is None else np.asarray(k, np.int64) for k in out_keys]
    arrays = [np.asarray(k, np.int64) for k in in_keys + out_keys if k is not None]
    offsets = np.cumsum([0] + [len(k) for k in arrays]).astype(np.int64)
    allk, pos = merge_sorted(np.concatenate(arrays), offsets)
    slices = iter(pos[a:b] for a, b in zip(offsets[:-1], offsets[1:]))
    need = [None if k is None else need_from_positions(next(slices), len(allk)) for k in in_keys]
    emit = [None if k is None else next(slices) for k in out_keys]
    return len(allk), need, emit


def chain_keys(chain: list) -> list:
    """chain[0] is the outermost stream, each next one its child; the last is keyed by its
    token index and every outer stream by closing_keys."""
    keys = [None] * len(chain)
    keys[-1] = np.arange(len(chain[-1]), dtype=np.int64)
    for k in range(len(chain) - 2, -1, -1):
        keys[k] = closing_keys(chain[k], chain[k + 1], keys[k + 1])
    return keys


def tile_size(s) -> int:
    if isinstance(s, Stream) and s.fval is not None and s.fval.ndim > 1:
        return int(max(s.fval.shape[1:]))
    return 0


# ---------------------------------------------------------------- per kind: (n, need, emit)

def _one_to_one(p, ins, outs):
    n = len(outs[0])
    for x in ins:
        if isinstance(x, Stream) and len(x) != n:
            raise ValueError(f"timing: {p.kind} input of {len(x)} tokens for {n} outputs")
    return n, [None if isinstance(x, Stream) else _storage_need(n) for x in ins], [None] * len(outs)


def _storage_need(n):
    need = np.full(n, 0, np.int64)
    return need


def _child_of(parent_slot: int):
    def deps(p, ins, outs):
        child = outs[0]
        n = len(child)
        need = []
        for k, x in enumerate(ins):
            if k == parent_slot:
                need.append(cummax_need(parent_dep(x, child, p.kind in ("scan", "range")), len(x)))
            elif isinstance(x, Stream):
                need.append(None)
            else:
                need.append(_storage_need(n))
        return n, need, [None] * len(outs)
    return deps


def _join(p, ins, outs):
    big = 1 + max([int(c.ival[c.kind == ELEM].max(initial=0)) for c in ins[0::2]] + [0])
    keys = [_merge_key(s, big) for s in ins[0::2]]
    in_keys = [k for k in keys for _ in (0, 1)]
    out_key = _merge_key(outs[0], big)
    return from_keys(in_keys, [out_key] * len(outs))


def _merge_key(s: Stream, big: int) -> np.ndarray:
    u = unit_of(s)
    base = u * (big + 1)
    return np.where(s.kind == ELEM, base + s.ival, base + big)  # N goes with its stop


def _reduce(p, ins, outs):
    vals, parent = ins
    vk = 2 * np.arange(len(vals), dtype=np.int64)
    pk = closing_keys(parent, vals, vk)
    nonunit = np.ones(len(parent), bool)
    nonunit[units(parent)] = False
    nonunit &= parent.kind == STOP
    pk = pk + nonunit  # S(n-1) leaves one step after the sum
    return from_keys([vk, pk], [pk])


def _accumulate(p, ins, outs):
    vals, crds, parent = ins[0], list(ins[1:-1]), ins[-1]
    chain = [parent] + crds if crds else [parent]
    keys = chain_keys(chain)
    if len(vals) != len(chain[-1]):
        raise ValueError(f"timing: {p.kind} values do not match their coordinates")
    return from_keys([keys[-1]] + keys[1:] + [keys[0]], [keys[0]], domain=len(keys[-1]), identity=keys[-1])


def _write(p, ins, outs):
    *crds, vals, parent = ins
    chain = [parent] + crds if crds else [parent]
    keys = chain_keys(chain)
    if len(vals) != len(chain[-1]):
        raise ValueError("timing: written values do not match their coordinates")
    last = np.array([keys[-1][-1]], np.int64)
    return from_keys(keys[1:] + [keys[-1], keys[0]], [last], domain=len(keys[-1]), identity=keys[-1])


def _root(p, ins, outs):
    return len(outs[0]), [], [None]


def _load(p, ins, outs):
    return 1, [np.zeros(1, np.int64) for _ in ins], [None]


def _fork(p, ins, outs):
    s = ins[0]
    item = is_item(s)
    lanes = len(outs)
    lane_of = (np.cumsum(item) - item) % lanes
    emit = [np.flatnonzero(~item | (lane_of == q)) for q in range(lanes)]
    return len(s), [None], emit


def _join_lanes(p, ins, outs):
    lanes = p.param("lanes")
    out = outs[0]
    n = len(out)
    if len(ins) == lanes:
        deps = _forked_deps(list(ins), out)
    elif p.param("below") == 0:
        lane_vals = deps = _forked_deps(list(ins[1 + lanes:]), out)
        deps = [np.arange(n)] + lane_vals + lane_vals
    else:
        deps = _below_deps(ins[0], list(ins[1:1 + lanes]), list(ins[1 + lanes:]), p.param("below"), n)
    return n, [cummax_need(d, len(x)) for d, x in zip(deps, ins)], [None]


def _forked_deps(lanes_in: list, out: Stream) -> list:
    lanes = len(lanes_in)
    n = len(out)
    deps = [np.full(n, -1, np.int64) for _ in lanes_in]
    items = np.flatnonzero(is_item(out))
    ctrl = np.flatnonzero(~is_item(out))
    g = np.arange(len(items))
    for q, s in enumerate(lanes_in):
        mine = g % lanes == q
        deps[q][items[mine]] = np.flatnonzero(is_item(s))[: int(mine.sum())]
        lane_ctrl = np.flatnonzero(~is_item(s))
        deps[q][ctrl] = lane_ctrl[: len(ctrl)]
    return deps


def _below_deps(merged, lane_cv, lane_streams, below, n) -> list:
    """The same segment arithmetic as parallel.join_below, keeping where each token came from."""
    lanes = len(lane_cv)
    segs = []
    for cv, s in zip(lane_cv, lane_streams):
        u = units(cv)
        bounds = np.flatnonzero((s.kind == STOP) & (s.ival >= below - 1))
        starts = np.concatenate(([0], bounds[:-1] + 1))
        iu = np.flatnonzero(is_item(cv)[u])
        segs.append((starts, bounds, u[iu]))
    mu = units(merged)
    m_item = is_item(merged)[mu]
    g = np.cumsum(m_item) - m_item
    lane = np.where(m_item, g % lanes, -1)
    local = g // lanes
    start = np.zeros(len(mu), np.int64)
    end = np.zeros(len(mu), np.int64)
    cvtok = np.zeros(len(mu), np.int64)
    for q in range(lanes):
        mine = lane == q
        st_, en_, ut = segs[q]
        start[mine], end[mine], cvtok[mine] = st_[local[mine]], en_[local[mine]], ut[local[mine]]
    length_ = np.where(m_item, end - start + 1, 1)
    first = np.cumsum(length_) - length_
    unit = np.repeat(np.arange(len(mu)), length_)
    src = start[unit] + np.arange(int(length_.sum())) - first[unit]
    deps = [np.concatenate((mu[unit], [len(merged) - 1]))]
    cv_deps, val_deps = [], []
    for q in range(lanes):
        mine = lane[unit] == q
        cv_deps.append(np.concatenate((np.where(mine, cvtok[unit], -1), [len(lane_cv[q]) - 1])))
        val_deps.append(np.concatenate((np.where(mine, src, -1), [len(lane_streams[q]) - 1])))
    if len(deps[0]) != n:
        raise ValueError("timing: join_lanes segments do not cover the merged stream")
    return deps + cv_deps + val_deps


DEPS = {"alu": _one_to_one, "read": _one_to_one, "fill": _one_to_one, "repsig": _one_to_one,
        "iota": _one_to_one, "scan": _child_of(1), "range": _child_of(0), "locate": _child_of(1),
        "repeat": _child_of(0), "join": _join, "reduce": _reduce, "spacc": _accumulate,
        "buffer": _accumulate, "write": _write, "buffer_write": _write, "root": _root, "load": _load,
        "fork": _fork, "join_lanes": _join_lanes}


# ---------------------------------------------------------------- costs per step

def step_costs(p: Prim, ins, outs, n: int, emit, timing: Timing):
    """Initiation interval and latency of every step: the kind's table entry, block-value costs
    on the steps that carry a tile (tile multiply 2b-1 / interval b, elementwise, reduce and
    array read b^2)."""
    ii, lat = timing.ii_of(p.kind), timing.lat_of(p.kind)
    src = outs[0] if p.kind in ("alu", "read") else None  # reducers: _reduce_costs
    b = tile_size(src) if src is not None else 0
    if not b:
        return ii, lat
    if p.kind == "alu" and p.param("contract"):
        carry = outs[0].kind == ELEM
        t_ii, t_lat = max(ii, b), max(lat, 2 * b - 1)
    elif p.kind == "alu":
        carry = outs[0].kind == ELEM
        t_ii, t_lat = max(ii, timing.tile_elementwise_ii), max(lat, b * b)
    else:
        carry = outs[0].kind == ELEM
        t_ii, t_lat = ii, max(lat, b * b)
    return np.where(carry, t_ii, ii).astype(np.int64), np.where(carry, t_lat, lat).astype(np.int64)


def schedule(p: Prim, ins, outs, timing: Timing, ctx: "Context") -> Schedule:
    n, need, emit = DEPS[p.kind](p, ins, outs)
    if p.kind in ("reduce", "spacc", "buffer"):
        ii, lat = _reduce_costs(p, ins, n, need, timing)
    else:
        ii, lat = step_costs(p, ins, outs, n, emit, timing)
    need = [_align_storage(p, k, x, need, ins, ctx) for k, x in enumerate(ins)]
    sched = Schedule(n, tuple(need), tuple(emit), ii, lat, channel=tuple(isinstance(x, Stream) for x in ins))
    return _memory(p, ins, outs, sched, timing, ctx)


def _reduce_costs(p, ins, n, need, timing):
    """Reducers: the steps that consume a value tile pay b^2 latency on what they emit."""
    b = tile_size(ins[0])
    ii, lat = timing.ii_of(p.kind), timing.lat_of(p.kind)
    if not b:
        return ii, lat
    took_value = _took_value(need[0], ins[0], n)
    # the sum leaves with the stop after the last value: carry the latency to that step
    carry = np.maximum.accumulate(np.where(took_value, np.arange(n), -1))
    hot = (carry >= 0) & (np.arange(n) - carry <= 1)
    return ii, np.where(hot, max(lat, b * b), lat).astype(np.int64)


def _took_value(vneed, vals: Stream, n: int) -> np.ndarray:
    """Per step, whether it takes a new value (ELEM) token of `vals`."""
    if vneed is None:
        return vals.kind == ELEM
    consumed = np.diff(np.concatenate(([-1], vneed)))  # tokens newly consumed at each step
    took = np.zeros(n, bool)
    idx = np.flatnonzero(consumed > 0)
    took[idx] = vals.kind[vneed[idx]] == ELEM
    return took


def _align_storage(p: Prim, slot: int, x, need: list, ins, ctx):
    """A reader of an accumulator's result through `iota` waits for the fiber it reads; deeper
    readers wait transitively through the level above; memory is ready from the start."""
    size = ctx.lengths.get(p.ins[slot], 1)
    if isinstance(x, Stream) or size <= 1:
        return need[slot]
    ref = 1 - slot if len(ins) == 2 else None
    if ref is not None and ctx.producer_kind(p.ins[ref]) == "iota" and len(ins[ref]) == size:
        return need[ref] if need[ref] is not None else np.arange(size, dtype=np.int64)
    return cummax_need(np.full(len(need[slot]), -1, np.int64), size)


def _memory(p: Prim, ins, outs, sched: Schedule, timing: Timing, ctx) -> Schedule:
    mem = timing.memory
    ch = ctx.mem_channel(p, ins)
    if mem is None or ch < 0:
        return replace(sched, mem_channel=ch)
    share = ctx.mem_share(ch)
    if p.kind in ("write",):
        vals = ins[-2]
        per = _bytes(vals, timing)
        req = _took_value(sched.need[-2], vals, sched.n)
    else:
        per = _bytes(outs[-1], timing) if p.kind == "read" else timing.crd_bytes
        req = outs[0].kind == ELEM
    interval = mem.interval * max(1, -(-per // mem.bytes_per_cycle)) * share
    ii = np.where(req, np.maximum(sched.ii, interval), sched.ii).astype(np.int64)
    lat = np.where(req, sched.lat + mem.latency, sched.lat).astype(np.int64)
    return replace(sched, ii=ii, lat=lat, start=mem.startup, mem_channel=ch)


def _bytes(s, timing: Timing) -> int:
    if isinstance(s, Stream) and s.fval is not None and s.fval.ndim > 1:
        return timing.value_bytes * int(np.prod(s.fval.shape[1:]))
    return timing.value_bytes


@dataclass
class Context:
    """What a schedule needs to know about the rest of the graph: who produced each stream,
    and the memory primitives' channels (dealt round-robin in graph order)."""

    producers: dict = field(default_factory=dict)
    lengths: dict = field(default_factory=dict)  # stream id -> tokens (pseudo streams too)
    channels: dict = field(default_factory=dict)
    clients: dict = field(default_factory=dict)

    @classmethod
    def of(cls, df, timing: Timing) -> "Context":
        ctx = cls({s: p for p in df.prims for s in p.outs})
        n_ch = timing.memory.channels if timing.memory else 1
        for p in df.prims:
            if ctx.is_memory(p):
                ch = len(ctx.channels) % n_ch
                ctx.channels[p.id] = ch
                ctx.clients[ch] = ctx.clients.get(ch, 0) + 1
        return ctx

    def producer_kind(self, sid: int) -> str:
        p = self.producers.get(sid)
        return p.kind if p is not None else ""

    def from_memory(self, sid: int) -> bool:
        p = self.producers.get(sid)
        return p is not None and p.kind == "load" and not p.ins

    def is_memory(self, p: Prim) -> bool:
        """Writers, array reads of memory, and scans of memory's compressed levels (dense
        levels are address arithmetic)."""
        if p.kind == "write":
            return True
        if p.kind not in ("scan", "read") or not self.from_memory(p.ins[0]):
            return False
        if p.kind == "scan":
            return self.producers[p.ins[0]].param("kinds")[p.param("level")] != "d"
        return True

    def mem_channel(self, p: Prim, ins) -> int:
        return self.channels.get(p.id, -1)

    def mem_share(self, ch: int) -> int:
        return self.clients.get(ch, 1)
