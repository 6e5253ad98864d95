"""Functional execution: every primitive is a function from whole input streams to whole output
streams (numpy arrays, no Python call per token), run in the graph's topological order.

Where we differ from spec/dataflow.md (tested in tests/targets/dataflow/test_primitives.py):
- `reduce` takes the parent stream as a second input and emits the reduction's identity (0)
  for an empty fiber instead of nothing, so that its output stays in lockstep with the other
  streams of its loop level (fused consumers combine it with them); writers store explicit zeros.
- `max` reductions count the implicit zeros of a fiber shorter than the variable's extent.
- joiners skip `N` coordinates (an N-fiber is empty), so one n-ary `join` with a formula over
  its inputs' presence stands for a tree of intersect and union joiners.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from . import kernels
from . import storage as S
from .graph import Dataflow, Prim
from .ops import apply_op
from .stream import (ELEM, EMPTY, STOP, Stream, ancestors, check_child, is_item, item_ordinal, merge_items,
                     root, unit_of)

FUNCS: dict[str, Callable] = {}


def prim(kind):
    def deco(fn):
        FUNCS[kind] = fn
        return fn
    return deco


def execute(df: Dataflow, env: dict, trace: dict | None = None, stats: dict | None = None) -> dict[str, torch.Tensor]:
    """Run the graph on the tensors in `env`; returns the written outputs. `trace`, when given,
    receives every stream by id (for tests and inspection); `stats` the tokens per primitive kind."""
    uses: dict[int, int] = {}
    for p in df.prims:
        for s in p.ins:
            uses[s] = uses.get(s, 0) + 1
    keep = {o.stream for o in df.outputs}
    vals: dict[int, object] = {}
    for p in df.prims:
        args = [vals[s] for s in p.ins]
        outs = FUNCS[p.kind](p, args, env)
        for s, o in zip(p.outs, outs):
            vals[s] = o
            if trace is not None:
                trace[s] = o
            if stats is not None and isinstance(o, Stream):
                stats[p.kind] = stats.get(p.kind, 0) + len(o)
        for s in p.ins:  # free a stream after its last consumer
            uses[s] -= 1
            if uses[s] == 0 and s not in keep:
                del vals[s]
    return {o.name: vals[o.stream] for o in df.outputs}


# ---------------------------------------------------------------- sources and memory

@prim("root")
def _root(p: Prim, args, env):
    return (root(),)


@prim("load")
def _load(p: Prim, args, env):
    t = args[0] if args else env[p.param("tensor")]
    kinds, tile = p.param("kinds"), p.param("tile")
    index = p.param("index")
    if index is None:
        return (S.from_torch(t, kinds, p.param("modes"), tile),)
    return (S.from_dense(_dense_view(t, index, p.param("vars"), dict(p.param("extents")), env), kinds, tile),)


def _dense_view(t: torch.Tensor, index, vars_, extents, env) -> np.ndarray:
    """A dense tensor read through index arithmetic, laid out over `vars_`: the dense levels'
    address generators compute these positions; here we gather them once."""
    from ...ir.index import evaluate

    dense = t.to_dense() if t.layout != torch.strided else t
    grid = {}
    for axis, v in enumerate(vars_):
        shape = [1] * len(vars_)
        shape[axis] = extents[v]
        grid[v] = torch.arange(extents[v]).view(shape)
    tensors = _DenseEnv(env)
    idx = [evaluate(e, grid, tensors) for e in index]
    full = [extents[v] for v in vars_]
    idx = [i.expand(full) if i.dim() else i.expand(full) for i in idx]
    out = dense[tuple(idx)] if idx else dense.expand(full)
    return S.dense_numpy(out.reshape(full) if out.dim() else out)


class _DenseEnv(dict):
    def __init__(self, env):
        super().__init__()
        self.env = env

    def __missing__(self, key):
        t = self.env[key]
        return t.to_dense() if t.layout != torch.strided else t


# ---------------------------------------------------------------- level scanning

@prim("scan")
def _scan(p: Prim, args, env):
    st, refs = args
    level = st.levels[p.param("level")]
    return scan(refs, level)


@prim("range")
def _range(p: Prim, args, env):
    crd, _ = scan(args[0], S.LevelData(S.DENSE, p.param("size")))
    return (crd,)


def scan(refs: Stream, level: S.LevelData) -> tuple[Stream, Stream]:
    """A level's fibers under each ref: (coordinate stream, ref stream); kernels.scan_level."""
    dense = level.kind == S.DENSE
    none = np.zeros(0, np.int64)
    kind, crd, ref = kernels.scan_level(refs.kind, refs.ival, dense, int(level.size or 0),
                                        none if dense else level.seg, none if dense else level.crd)
    return Stream(kind, crd), Stream(kind.copy(), ref)


@prim("locate")
def _locate(p: Prim, args, env):
    crd, refs = args
    out = repeat(refs, crd)
    items = out.kind == ELEM
    ok = items & (crd.kind == ELEM)
    out.ival = np.where(ok, out.ival * p.param("size") + crd.ival, out.ival)
    out.kind = np.where(items & (crd.kind == EMPTY), EMPTY, out.kind).astype(np.int8)
    return (out,)


@prim("repsig")
def _repsig(p: Prim, args, env):
    s = args[0]
    return (Stream(s.kind.copy(), np.where(s.kind == STOP, s.ival, 0)),)


@prim("repeat")
def _repeat(p: Prim, args, env):
    return (repeat(args[0], args[1]),)


def repeat(x: Stream, sig: Stream) -> Stream:
    """x (depth d) repeated over the fibers of sig (depth d+1): sig's structure, x's items."""
    u = check_child(x, sig, "repeat")
    kind, ival, src = kernels.repeat_tokens(u, x.kind, x.ival, sig.kind, sig.ival)
    fval = None
    if x.fval is not None and x.fval.ndim == 1:
        fval = kernels.gather_values(x.fval, src)
    elif x.fval is not None:
        items = src >= 0
        fval = np.zeros((len(sig),) + x.fval.shape[1:], np.float64)
        fval[items] = x.fval[src[items]]
    return Stream(kind, ival, fval)


# ---------------------------------------------------------------- joiners

@prim("join")
def _join(p: Prim, args, env):
    formula = p.param("formula")
    pairs = [(args[2 * i], args[2 * i + 1]) for i in range(len(args) // 2)]
    return join(pairs, formula)


def join(pairs, formula) -> tuple[Stream, ...]:
    template = pairs[0][0]
    n_stop = int(np.count_nonzero(template.kind == STOP))
    keys, refs = [], []
    big = 1 + max((int(c.ival[c.kind == ELEM].max(initial=0)) for c, _ in pairs), default=0)
    for crd, ref in pairs:
        if int(np.count_nonzero(crd.kind == STOP)) != n_stop:
            raise ValueError("join: inputs' stops do not align")
        items = crd.kind == ELEM
        keys.append(unit_of(crd)[items] * big + crd.ival[items])  # sorted: fibers in order
        refs.append(ref.ival[items])
    allkeys = _superset(formula, keys)
    n = len(allkeys)
    present, where = [], []
    for kk in keys:  # binary search of each (usually short) input in the candidate keys
        at = np.searchsorted(allkeys, kk)
        ok = at < n
        ok[ok] = allkeys[at[ok]] == kk[ok]
        pres = np.zeros(n, bool)
        pres[at[ok]] = True
        pos = np.zeros(n, np.int64)
        pos[at[ok]] = np.flatnonzero(ok)
        present.append(pres)
        where.append(pos)
    mask = _formula(formula, present, n)
    out_keys = allkeys[mask]
    unit = out_keys // big
    crd = merge_items(unit, template, {"kind": np.full(len(unit), ELEM, np.int8), "ival": out_keys % big})
    outs = [crd]
    for ok, at, r in zip(present, where, refs):
        ok, at = ok[mask], at[mask]
        kind = np.where(ok, ELEM, EMPTY).astype(np.int8)
        ival = np.where(ok, r[at] if len(r) else 0, 0)
        outs.append(merge_items(unit, template, {"kind": kind, "ival": ival}))
    return tuple(outs)


def _superset(f, keys) -> np.ndarray:
    """Sorted keys that contain every key the formula can select (no full sort when an
    intersection has a short input or a dense source gives every coordinate)."""
    if f is True:
        return np.unique(np.concatenate(keys)) if len(keys) > 1 else keys[0]
    if isinstance(f, int):
        return keys[f]
    parts = [_superset(x, keys) for x in f[1]]
    if f[0] == "and":
        return min(parts, key=len)
    return np.unique(np.concatenate(parts))


def _formula(f, present, n) -> np.ndarray:
    if f is True:
        return np.ones(n, bool)
    if isinstance(f, int):
        return present[f]
    op, parts = f
    masks = [_formula(x, present, n) for x in parts]
    out = masks[0].copy()
    for m in masks[1:]:
        out = out & m if op == "and" else out | m
    return out


# ---------------------------------------------------------------- values

@prim("read")
def _read(p: Prim, args, env):
    st, refs = args
    return (read(st, refs),)


def read(st: S.Storage, refs: Stream) -> Stream:
    if st.values.ndim == 1:
        return Stream(*kernels.read_values(refs.kind, refs.ival, st.values.astype(np.float64, copy=False)))
    elem = refs.kind == ELEM
    fval = np.zeros((len(refs),) + st.values.shape[1:], np.float64)
    fval[elem] = st.values[refs.ival[elem]]
    kind = np.where(refs.kind == EMPTY, ELEM, refs.kind).astype(np.int8)
    return Stream(kind, np.where(kind == STOP, refs.ival, 0), fval)


@prim("fill")
def _fill(p: Prim, args, env):
    d = args[0]
    kind = np.where(d.kind == EMPTY, ELEM, d.kind).astype(np.int8)
    fval = np.where(kind == ELEM, float(p.param("value")), 0.0)
    return (Stream(kind, np.where(kind == STOP, d.ival, 0), fval),)


@prim("alu")
def _alu(p: Prim, args, env):
    consts = dict(p.param("consts"))
    operands, streams = [], iter(args)
    first = None
    n_ops = p.param("arity")
    for k in range(n_ops):
        if k in consts:
            operands.append(consts[k])
            continue
        s = next(streams)
        if first is None:
            first = s
        elif len(s) != len(first) or not np.array_equal(s.kind, first.kind):
            raise ValueError(f"ALU {p.param('op')}: operand streams are not in lockstep")
        operands.append(s)
    mask = first.kind == ELEM
    if not p.param("contract") and all(o.fval.ndim == 1 for o in operands if isinstance(o, Stream)):
        return (_scalar_alu(p, operands, first, mask),)
    axes_in = p.param("axes_in") or [()] * n_ops
    axes_out = p.param("axes_out") or ()
    arrays = [_aligned(o.fval[mask], ax, axes_out) if isinstance(o, Stream) else o for o, ax in zip(operands, axes_in)]
    res = apply_op(p.param("op"), arrays, p.param("dtype"), p.param("contract") or (), axes_out)
    fval = np.zeros((len(first),) + tuple(np.shape(res)[1:]), np.float64)
    fval[mask] = res
    return (Stream(first.kind.copy(), np.where(first.kind == STOP, first.ival, 0), fval),)


def _scalar_alu(p: Prim, operands: list, first: Stream, mask: np.ndarray) -> Stream:
    """Scalar values: the op over every token at once (control tokens carry 0 and get 0
    back), which saves gathering the elements out and scattering the results back."""
    arrays = [o.fval if isinstance(o, Stream) else o for o in operands]
    with np.errstate(all="ignore"):
        fval = np.asarray(apply_op(p.param("op"), arrays, p.param("dtype")), dtype=np.float64)
    if fval.shape != first.kind.shape or any(fval is a for a in arrays):  # never alias an input
        fval = np.broadcast_to(fval, first.kind.shape).copy()
    fval[~mask] = 0.0
    return Stream(first.kind.copy(), np.where(first.kind == STOP, first.ival, 0), fval)


def _aligned(arr: np.ndarray, axes: tuple, out_axes: tuple) -> np.ndarray:
    """A tile array (n, *axes) laid out for broadcasting against (n, *out_axes)."""
    if not out_axes or tuple(axes) == tuple(out_axes):
        return arr
    perm = [0] + [1 + axes.index(a) for a in out_axes if a in axes]
    arr = arr.transpose(perm)
    shape = [arr.shape[0]] + [arr.shape[1 + [a for a in out_axes if a in axes].index(a)] if a in axes else 1
                              for a in out_axes]
    return arr.reshape(shape)


@prim("reduce")
def _reduce(p: Prim, args, env):
    vals, parent = args
    u = check_child(parent, vals, "reduce")
    elem = vals.kind == ELEM
    uo = unit_of(vals)[elem]
    v = _tile_reduce(vals.fval[elem], p)
    red = _segment_reduce(v, uo, len(u), p.param("op"), p.param("extent"))
    kind = np.where(is_item(parent), ELEM, parent.kind).astype(np.int8)
    fval = np.zeros((len(parent),) + red.shape[1:], np.float64)
    ui = is_item(parent)[u]
    fval[u[ui]] = red[ui]
    return (Stream(kind, np.where(kind == STOP, parent.ival, 0), fval),)


def _tile_reduce(v: np.ndarray, p: Prim) -> np.ndarray:
    """Blocked values: sum (or max) away the tile axes of the reduced variables."""
    axes = p.param("tile_axes") or ()
    if not axes:
        return v
    ax = tuple(1 + a for a in axes)
    return v.max(axis=ax) if p.param("op") == "max" else v.sum(axis=ax)


def _segment_reduce(v: np.ndarray, seg: np.ndarray, n: int, op: str, extent) -> np.ndarray:
    """Reduce v over runs of equal (sorted) segment ids 0..n-1; empty segments give 0."""
    out = np.zeros((n,) + v.shape[1:], np.float64)
    if len(v) == 0:
        return out
    starts = np.flatnonzero(np.concatenate(([True], seg[1:] != seg[:-1])))
    ids = seg[starts]
    if op == "max":
        red = np.maximum.reduceat(v, starts, axis=0)
        counts = np.diff(np.concatenate((starts, [len(v)])))
        short = counts < (extent or 0)  # implicit zeros take part in a max
        if short.any():
            red[short] = np.maximum(red[short], 0.0)
    else:
        red = np.add.reduceat(v, starts, axis=0)
    out[ids] = red
    return out


@prim("spacc")
def _spacc(p: Prim, args, env):
    return (accumulate(args[0], list(args[1:-1]), args[-1], p),)


@prim("buffer")
def _buffer(p: Prim, args, env):
    return (accumulate(args[0], list(args[1:-1]), args[-1], p),)


def accumulate(vals: Stream, crds: list[Stream], parent: Stream, p: Prim) -> S.Storage:
    """Accumulate values by their kept coordinates under each parent item; the result is a
    fibertree whose first (dense) level is indexed by the parent item's ordinal."""
    reduced = p.param("reduced") or ()
    anc = ancestors([parent] + crds)
    last = crds[-1]
    pick = last.kind[anc[-1]] == ELEM
    anc = [a[pick] for a in anc]
    ordinal = item_ordinal(parent)[anc[0]]
    kept = [k for k in range(len(crds)) if k not in reduced]
    cols = [ordinal] + [crds[k].ival[anc[k + 1]] for k in kept]
    values = _tile_reduce(vals.fval[anc[-1]], p) if reduced else vals.fval[anc[-1]]
    n_parent = int(np.count_nonzero(is_item(parent)))
    sizes = [n_parent] + [p.param("sizes")[k] for k in kept]
    dense = p.param("dense", 0)  # a buffer's leading levels addressed by coordinate (Lowerer.branch)
    kinds = (S.DENSE,) * (1 + dense) + (S.COMPRESSED,) * (len(kept) - dense)
    dense_size = int(np.prod(sizes, dtype=np.float64)) if sizes else 1
    if reduced and values.ndim == 1 and dense_size <= DENSE_ACC_LIMIT:
        return _dense_accumulate(cols, values, sizes, kinds, p, reduced)
    coords = np.stack(cols, axis=1)
    if reduced and len(coords):
        order = np.lexsort(coords.T[::-1])
        coords, values = coords[order], values[order]
        new = np.ones(len(coords), bool)
        new[1:] = (coords[1:] != coords[:-1]).any(axis=1)
        group = np.cumsum(new) - 1
        extent = int(np.prod([p.param("sizes")[k] for k in reduced]))
        values = _segment_reduce(values, group, int(new.sum()), p.param("op"), extent)
        coords = coords[new]
    return S.from_coo(coords, values, tuple(sizes), kinds, p.param("tile") or ())


DENSE_ACC_LIMIT = 1 << 26


def _dense_accumulate(cols, values, sizes, kinds, p: Prim, reduced) -> S.Storage:
    """The accumulator as a dense array indexed by the kept coordinates (one pass, no sort);
    the stored entries are those that received at least one value."""
    key = np.zeros(len(values), np.int64)
    for c, n in zip(cols, sizes):
        key = key * n + c
    total = int(np.prod(sizes, dtype=np.float64)) if sizes else 1
    count = np.bincount(key, minlength=total)
    if p.param("op") == "max":
        acc = np.full(total, -np.inf)
        np.maximum.at(acc, key, values)
        extent = int(np.prod([p.param("sizes")[k] for k in reduced]))
        acc = np.where(count < extent, np.maximum(acc, 0.0), acc)
    else:
        acc = np.bincount(key, weights=values, minlength=total)
    present = np.flatnonzero(count)
    coords = np.stack(np.unravel_index(present, sizes), axis=1) if sizes else np.zeros((len(present), 0), np.int64)
    return S.from_coo(coords, acc[present], tuple(sizes), kinds, p.param("tile") or (), presorted=True)


@prim("fork")
def _fork(p: Prim, args, env):
    from .parallel import fork

    return fork(args[0], p.param("lanes"))


@prim("join_lanes")
def _join_lanes(p: Prim, args, env):
    from .parallel import join_below, join_forked

    lanes = p.param("lanes")
    if len(args) == lanes:  # the forked level's own coordinates
        return (join_forked(list(args)),)
    merged, rest = args[0], list(args[1:])
    if p.param("below") == 0:  # streams at the forked level (values of its items)
        return (join_forked(rest[lanes:]),)
    return (join_below(merged, rest[:lanes], rest[lanes:], p.param("below")),)


@prim("iota")
def _iota(p: Prim, args, env):
    d = args[0]
    kind = d.kind.copy()
    ival = np.where(kind == ELEM, item_ordinal(d), np.where(kind == STOP, d.ival, 0))
    return (Stream(kind, ival),)


# ---------------------------------------------------------------- writers

@prim("buffer_write")
def _buffer_write(p: Prim, args, env):
    """An intermediate the region keeps in an on-chip buffer (written once, read by address)."""
    return _write(p, args, env)


@prim("write")
def _write(p: Prim, args, env):
    return (finish_output(p, write_into(p, args, blank_output(p))),)


def blank_output(p: Prim) -> np.ndarray:
    """The zeros a writer scatters into: float64, blocked dims padded to whole tiles."""
    shape, dims = p.param("shape"), p.param("dims")
    tile = p.param("tile") or ()
    full = list(shape)
    for k, d in enumerate(dims):
        if tile and tile[k] > 1:
            full[d] = -(-shape[d] // tile[k]) * tile[k]
    return np.zeros(full, np.float64)


def write_into(p: Prim, args, out: np.ndarray) -> np.ndarray:
    """Scatter the writer's values into `out` (from blank_output; a chunked run passes the same
    one to every chunk, whose rows are disjoint) and return it."""
    *crds, vals, parent = args
    if crds:
        anc = ancestors([parent] + crds)
        pick = crds[-1].kind[anc[-1]] == ELEM
        anc = [a[pick] for a in anc]
        coords = [crds[k].ival[anc[k + 1]] for k in range(len(crds))]
        values = vals.fval[anc[-1]]
        perm = p.param("tile_perm") or ()
        if perm:  # tile axes into coordinate-column order
            values = values.transpose((0,) + tuple(1 + a for a in perm))
    else:
        coords, values = [], vals.fval[vals.kind == ELEM][:1]
    _scatter(out, coords, values, p.param("dims"), p.param("tile") or ())
    return out


def finish_output(p: Prim, out: np.ndarray) -> torch.Tensor:
    """The written array as the output tensor: padding cropped, in the writer's dtype."""
    shape = p.param("shape")
    if list(out.shape) != list(shape):
        out = np.ascontiguousarray(out[tuple(slice(0, n) for n in shape)])
    result = torch.from_numpy(out)
    dtype = getattr(torch, p.param("dtype"))
    if dtype == torch.bool:
        return result != 0
    return result.to(dtype)


def _scatter(out, coords, values, dims, tile):
    """out[dims...] = values, where dims[k] is the output dim of coordinate column k; with
    tiles, coordinates are block indices and each value is a tile over the blocked columns."""
    if not tile or all(t == 1 for t in tile):
        idx = [None] * out.ndim
        for k, d in enumerate(dims):
            idx[d] = coords[k]
        if out.ndim == 0:
            out[...] = values[0] if len(values) else 0.0
        else:
            out[tuple(idx)] = values
        return
    blocked = [k for k, t in enumerate(tile) if t > 1]
    n = len(values)
    rank = 1 + len(blocked)
    idx = [None] * out.ndim
    for k, d in enumerate(dims):  # each tile entry's output index, broadcast over the tile axes
        shape = [n] + [1] * len(blocked)
        at = np.asarray(coords[k]).reshape(shape)
        if tile[k] > 1:
            q = blocked.index(k)
            inner = np.arange(tile[k]).reshape([1] + [tile[k] if a == q else 1 for a in range(rank - 1)])
            at = at * tile[k] + inner
        idx[d] = at
    out[tuple(idx)] = values.reshape((n,) + tuple(tile[k] for k in blocked))
