"""Dataflow orders: the partial order that storage imposes on index variables, every legal
total order (its topological sorts), and the default order chosen by a static token estimate.

A compressed level can only be scanned inside the level above it, so a sparse view stored in
mode order (i, k) forces i before k. Dense levels are addressed by arithmetic (a dense ref is
`parent * size + c`), so dense views impose nothing. Computed leaves (buffers) are built in
the dataflow order itself.
"""

from __future__ import annotations

import itertools
import random
import weakref

import networkx as nx
import numpy as np

from ...ir.graph import Graph
from .rexpr import Red, all_vars, views

CANDIDATES = 24
DEFAULT_DENSITY = 0.05  # guess for sparse inputs whose values are unknown at compile time


def constraints(expr, graph: Graph, skip=frozenset()) -> nx.DiGraph:
    dag = nx.DiGraph()
    dag.add_nodes_from(sorted(all_vars(expr)))
    for view in sorted(views(expr), key=str):
        fmt = graph.type_of[view.tensor].format
        if fmt.is_dense or not view.plain or str(view) in skip:
            continue
        names = [view.index[m].name for m in fmt.mode_order]
        for a, b in zip(names, names[1:]):
            dag.add_edge(a, b, why=f"{view} is stored {fmt} ({a} before {b})")
    return dag


def constraints_without(expr, graph: Graph, skip: set) -> nx.DiGraph:
    return constraints(expr, graph, frozenset(skip))


def reformat_to_break_cycles(expr, graph: Graph) -> set:
    """Sparse views to reformat (re-store in the dataflow order at load, a transpose in memory)
    so that some order fits: the last-read views of each conflict first."""
    skip: set = set()
    dag = constraints(expr, graph)
    while not nx.is_directed_acyclic_graph(dag):
        cycle = nx.find_cycle(dag)
        whys = [dag.edges[a, b]["why"] for a, b in cycle]
        culprit = sorted({w.split(" is stored")[0] for w in whys})[-1]
        skip.add(culprit)
        dag = constraints_without(expr, graph, skip)
    return skip


def conflict(dag: nx.DiGraph) -> str | None:
    if nx.is_directed_acyclic_graph(dag):
        return None
    cycle = nx.find_cycle(dag)
    whys = "; ".join(dag.edges[a, b]["why"] for a, b in cycle)
    return f"no dataflow order fits the storage orders ({whys}); store one of the tensors in the other mode order"


def legal_orders(dag: nx.DiGraph):
    """Every legal dataflow order, lazily, in networkx's enumeration order."""
    return (tuple(o) for o in nx.all_topological_sorts(dag))


def check(order, dag: nx.DiGraph) -> str | None:
    order = tuple(order)
    if sorted(order) != sorted(dag.nodes):
        return f"order {order} must list the variables {tuple(sorted(dag.nodes))} once each"
    pos = {v: k for k, v in enumerate(order)}
    for a, b, why in dag.edges(data="why"):
        if pos[a] > pos[b]:
            return f"order {' '.join(order)} puts {b} before {a}, but {why}"
    return None


def pick(spec, dag: nx.DiGraph, streamed=None) -> tuple | None:
    """options['order']: an int index into legal_orders, or an explicit tuple of names.
    `streamed(order) -> why | None`: with hoist=False, the extra legality of the streamed nest
    (streamed_conflict); an int then indexes the orders that pass it."""
    if spec is None:
        return None
    if isinstance(spec, int):
        orders = legal_orders(dag)
        if streamed is not None:
            orders = (o for o in orders if streamed(o) is None)
        found = next(itertools.islice(orders, spec, None), None)
        if found is None:
            raise ValueError(f"order index {spec} is out of range: there are fewer legal orders")
        return found
    if isinstance(spec, str):
        spec = tuple(spec.replace(",", " ").split())
    why = check(spec, dag) or (streamed(tuple(spec)) if streamed is not None else None)
    if why:
        raise ValueError(why)
    return tuple(spec)


def candidates(expr, out_vars, dag: nx.DiGraph, seed: int = 0, rows_first: bool = False) -> list[tuple]:
    """Heuristic orders: outputs first (streaming, FuseFlow's fused loop nest), nested
    reductions first (hoisting them into buffers), seeded random topological sorts, and with
    `rows_first` one per output variable: that variable outermost, then the hoisting order (the
    nested reductions computed once per row into buffers the rest of the row reads, so that
    rows pipeline through the region's stages)."""
    hoisting = _rank_hoisting(expr, out_vars)
    found = [_lex(dag, _rank_streaming(expr, out_vars)), _lex(dag, hoisting)]
    rng = random.Random(seed)
    names = sorted(dag.nodes)
    for _ in range(CANDIDATES):
        rank = {v: rng.random() for v in names}
        found.append(_lex(dag, rank))
    if rows_first:
        found += [_lex(dag, {u: (-1 if u == v else r) for u, r in hoisting.items()}) for v in out_vars]
    return list(dict.fromkeys(found))


def _lex(dag, rank) -> tuple:
    return tuple(nx.lexicographical_topological_sort(dag, key=lambda v: (rank.get(v, 1e9), v)))


def _preorder_vars(e, out: list):
    from .rexpr import Op, View

    if isinstance(e, View):
        for i in e.index:
            for v in sorted(_free_index(i)):
                out.append(v)
    elif isinstance(e, Op):
        for a in e.args:
            _preorder_vars(a, out)
    elif isinstance(e, Red):
        _preorder_vars(e.body, out)


def _free_index(i):
    from ...ir.index import free_vars

    return free_vars(i)


def _rank_streaming(expr, out_vars) -> dict:
    seq = list(out_vars)
    _preorder_vars(expr, seq)
    rank: dict = {}
    for v in seq:
        rank.setdefault(v, len(rank))
    return rank


def _rank_hoisting(expr, out_vars) -> dict:
    """Reduction variables of the most deeply nested reductions first."""
    seq: list = []

    def post(e):
        from .rexpr import Op

        if isinstance(e, Red):
            post(e.body)
            inner = []
            _preorder_vars(e.body, inner)
            seq.extend(v for v in inner if v in e.rvars)
            seq.extend(e.rvars)
        elif isinstance(e, Op):
            for a in e.args:
                post(a)

    post(expr.body if isinstance(expr, Red) else expr)
    seq += list(out_vars)
    _preorder_vars(expr, seq)
    rank: dict = {}
    for v in seq:
        rank.setdefault(v, len(rank))
    return rank


# ---------------------------------------------------------------- static token estimate

def estimate(df, fibers: dict[int, list[float]], biased: dict[int, list[float]] | None = None) -> float:
    """Tokens all primitives emit, estimated without data: `fibers[load stream]` gives the
    mean fiber length of each level of a loaded tensor (`biased`, where known, the size-biased
    mean: see stream_tokens)."""
    tokens = stream_tokens(df, fibers, biased=biased)
    return sum(tokens[s] for p in df.prims if p.kind not in ("load", "write") for s in p.outs)


def stream_tokens(df, fibers: dict[int, list[float]], steps: bool = False,
                  biased: dict[int, list[float]] | None = None) -> dict[int, float]:
    """Estimated tokens of every stream (`estimate`'s counts). `steps` counts what primitives step
    over, for the cycle estimate: also the stop closing each fiber a scan or range opens, one value
    per ref a read takes (its storage operand is not a stream), an ALU's longest input.
    A fiber located at the coordinates of an inner sparse level (a neighbour's index), rather than
    walked in turn, counts its tensor's size-biased mean length (`biased[load stream]`): GCN's A[k1, :]
    at each non-zero A[i, k1] is a hub's row as often as the hub is a neighbour, sum(deg^2) / sum(deg)
    long; a row located at the outer loop's own coordinate is read once, at the plain mean."""
    n: dict[int, float] = {}
    per_level: dict[int, list[float]] = dict(fibers)
    closing = 1.0 if steps else 0.0
    # coordinates of an inner level's non-zeros (a neighbour's index: each coordinate comes again under
    # other outer coordinates, as often as it is a neighbour; an outer level's come once), and refs located at them
    neighbours, located = set(), set()
    for p in df.prims:
        ins = [n.get(s, 0.0) for s in p.ins]
        k = p.kind
        if (k == "scan" and p.param("level") >= 1) or (k == "join" and neighbours.intersection(p.ins[0::2])):
            neighbours.add(p.outs[0])
        elif (k == "locate" and p.ins[0] in neighbours) or (k == "repeat" and p.ins[0] in located):
            located.add(p.outs[0])
        if k == "root":
            outs = [1.0]
        elif k in ("load",):
            outs = [0.0]
        elif k == "scan":
            fib = per_level.get(p.ins[0], [])
            if biased and p.ins[1] in located and p.ins[0] in biased:
                fib = biased[p.ins[0]]
            lvl = p.param("level")
            f = fib[lvl] if lvl < len(fib) else 1.0
            outs = [ins[1] * (f + closing)] * 2
        elif k == "range":
            outs = [ins[0] * (p.param("size") + closing)]
        elif k == "join":
            items = ins[0::2]
            outs = [_formula_size(p.param("formula"), items)] * (1 + len(items))
        elif k in ("locate", "repeat"):
            outs = [ins[0] if k == "locate" else ins[1]]
        elif k == "reduce":
            outs = [ins[1]]
        elif k in ("spacc", "buffer"):
            parent, values = max(ins[-1], 1.0), ins[0]
            sizes = p.param("sizes")
            kept = [s for j, s in enumerate(sizes) if j not in (p.param("reduced") or ())]
            fl, left = [], values / parent
            for s in kept:
                f = min(float(s), max(left, 1.0))
                fl.append(f)
                left /= max(f, 1.0)
            per_level[p.outs[0]] = [1.0] + fl
            outs = [values]
        elif k == "iota":
            outs = [ins[0]]
        elif k == "read" and steps:
            outs = [ins[1]]
        elif k == "alu" and steps:
            outs = [max(ins, default=0.0)]
        elif k == "write":
            outs = [0.0]
        else:
            outs = [ins[0] if ins else 0.0] * len(p.outs)
        for s, x in zip(p.outs, outs):
            n[s] = x
    return n


STORAGE_KINDS = ("load", "spacc", "buffer", "buffer_write")
TILE_VALUED = ("alu", "read", "reduce", "spacc", "buffer")  # with blocking, their tokens are b x b tiles


def estimate_cycles(df, fibers: dict[int, list[float]], block: int | None = None,
                    biased: dict[int, list[float]] | None = None) -> float:
    """Cycles of a dataflow graph, estimated without data, as the latest finish of a primitive
    along its critical path (spec/dataflow.md's timing): each primitive steps once per token it
    consumes or emits, at interval 1 (b for a b x b tile contraction), and its first token
    leaves one hop after its inputs' first (b^2 cycles for a tile-valued primitive); it cannot
    finish before its inputs finish. A reader of an accumulator or buffer starts once the first
    of its fibers is complete (1 / parent fibers of the accumulation), so an order that
    accumulates a whole matrix before the next stage may read it pays the stages one after the
    other, where an order that accumulates row by row overlaps them. With blocking, loaded
    levels count tiles (their `tile` extents), as scans, ranges and accumulators do."""
    if block:
        fibers, biased = _tiled(df, fibers), _tiled(df, biased) if biased else None
    n = stream_tokens(df, fibers, steps=True, biased=biased)
    storage = {s for p in df.prims if p.kind in STORAGE_KINDS for s in p.outs}
    ready: dict[int, float] = {}
    done: dict[int, float] = {}
    end = 0.0
    for p in df.prims:
        accumulates = p.kind in ("spacc", "buffer")
        steps = max((n.get(s, 0.0) for s in p.ins + p.outs if accumulates or s not in storage), default=0.0)
        busy = steps * (block if block and p.kind == "alu" and p.param("contract") else 1)
        hop = block * block if block and p.kind in TILE_VALUED else 1
        start = max((ready.get(s, 0.0) for s in p.ins), default=0.0)
        finish = max([start + busy + hop] + [done.get(s, 0.0) for s in p.ins])
        # an accumulator's first fiber is complete once the first 1/parents of its input arrived
        span = max([busy] + [done.get(s, 0.0) - start for s in p.ins]) if accumulates else 0.0
        first = start + hop + (span / max(n.get(p.ins[-1], 1.0), 1.0) if accumulates else 0.0)
        for s in p.outs:
            ready[s], done[s] = first, finish
        end = max(end, finish)
    return end


def _tiled(df, fibers: dict[int, list[float]]) -> dict[int, list[float]]:
    """Loaded tensors' fiber lengths in tiles where the lowering blocks their levels."""
    out = dict(fibers)
    for p in df.prims:
        tile = p.param("tile") if p.kind == "load" else None
        if tile and p.outs and p.outs[0] in out:
            out[p.outs[0]] = [max(f / t, 1.0) if t > 1 else f for f, t in zip(out[p.outs[0]], tile)]
    return out


def _formula_size(f, items) -> float:
    if f is True:
        return items[0]
    if isinstance(f, int):
        return items[f]
    parts = [_formula_size(x, items) for x in f[1]]
    return min(parts) if f[0] == "and" else sum(parts)


def level_fibers(value, fmt, mode_order) -> list[float]:
    """Mean fiber length per level of a tensor in a format (exact when its values are known)."""
    return level_fiber_moments(value, fmt, mode_order)[0]


def level_fiber_moments(value, fmt, mode_order) -> tuple[list[float], list[float]]:
    """Per level, the mean fiber length (the distinct coordinate prefixes of the non-zeros at that level over
    those of the level above) and the size-biased mean, sum(len^2) / sum(len): a fiber's expected length when
    fibers are picked in proportion to their length, as a row of a graph's adjacency is when located at the
    coordinates of another row's non-zeros (a hub is everyone's neighbour). Counted on the non-zeros'
    coordinates, so that a sparse tensor is never made dense (Collab's adjacency has 5.6e10 entries)."""
    if value is None:
        return [], []
    shape = [int(value.shape[m]) for m in mode_order]
    if fmt.is_dense or fmt.block is not None or not shape:
        return [float(s) for s in shape], [float(s) for s in shape]
    coords = _nonzero_coordinates(value)[list(mode_order)]
    if coords.shape[1] == 0:
        return [0.0] * len(shape), [0.0] * len(shape)
    coords = coords[:, np.lexsort(coords[::-1])]
    starts = np.zeros(coords.shape[1], dtype=bool)  # where a new prefix of the levels so far begins
    starts[0] = True
    means, biased, parent_of = [], [], np.zeros(coords.shape[1], dtype=np.int64)
    for lvl in range(len(shape)):
        starts[1:] |= coords[lvl, 1:] != coords[lvl, :-1]
        lengths = np.bincount(parent_of[starts])  # each parent prefix's distinct children at this level
        means.append(float(lengths.sum()) / len(lengths))
        biased.append(float((lengths.astype(np.float64) ** 2).sum()) / float(lengths.sum()))
        parent_of = np.cumsum(starts) - 1
    return means, biased


def _nonzero_coordinates(value) -> np.ndarray:
    """(ndim, nnz) coordinates of a tensor's non-zeros, from its sparse structure where it has one."""
    import torch

    if value.layout == torch.strided:
        return torch.nonzero(value).T.numpy()
    coo = value.to_sparse_coo().coalesce()
    stored = coo.values() != 0
    if stored.dim() > 1:  # a hybrid tensor's dense part: an entry counts where any of its values does
        stored = stored.flatten(1).any(1)
    return coo.indices()[:, stored].numpy()


# counts of the tensors seen, by (id, version, mode order): one program's regions, and the configurations an
# exploration compiles, read the same adjacency (Collab's takes 0.6 s to count); an entry goes with its tensor
_COUNTED: dict[tuple, tuple[list[float], list[float]]] = {}


def _counted_moments(value, fmt, mode_order) -> tuple[list[float], list[float]]:
    if fmt.is_dense or fmt.block is not None:
        return level_fiber_moments(value, fmt, mode_order)
    key = (id(value), value._version, tuple(mode_order))
    if key not in _COUNTED:
        if not any(k[0] == key[0] for k in _COUNTED):
            weakref.finalize(value, _forget, key[0])
        _COUNTED[key] = level_fiber_moments(value, fmt, mode_order)
    return _COUNTED[key]


def _forget(ident: int) -> None:
    for key in [k for k in _COUNTED if k[0] == ident]:
        del _COUNTED[key]


class KnownFibers:
    """Level fiber lengths of the tensors whose values are known at compile time (parameters, and the
    example inputs a program is compiled on), by name; each tensor is counted once per mode order."""

    def __init__(self, values: dict):
        self.values = values

    def __contains__(self, name) -> bool:
        return name in self.values

    def fibers(self, name: str, fmt, mode_order) -> list[float]:
        return _counted_moments(self.values[name], fmt, mode_order)[0]

    def biased(self, name: str, fmt, mode_order) -> list[float]:
        """Size-biased mean fiber lengths (level_fiber_moments)."""
        return _counted_moments(self.values[name], fmt, mode_order)[1]


def guessed_fibers(fmt, shape_in_level_order) -> list[float]:
    """Fiber lengths of a sparse input whose values are unknown: outer compressed levels
    assumed full, the last one DEFAULT_DENSITY full."""
    last = len(shape_in_level_order) - 1
    return [float(s) if (str(lv) == "d" or k < last) else max(1.0, s * DEFAULT_DENSITY)
            for k, (lv, s) in enumerate(zip(fmt.levels, shape_in_level_order))]


# ---------------------------------------------------------------- the streamed loop nest (hoist=False)

def streamed_conflict(expr, out_vars, order, graph: Graph, reformat=frozenset(), block=None) -> str | None:
    """Why `order` cannot be walked with hoist=False, or None.

    With hoisting off, a nested reduction is computed only where its consumer's walk reaches it
    (lower.Lowerer.due does not look inside a reduction that is not due yet), so the loop nest
    is not the order itself: the variables of a reduction nested in a consumer are iterated
    inside the consumer's loops, and a sparse view in it is scanned at the consumer's levels
    first. The storage DAG alone (constraints) is then not enough: e.g. GCN's
    layer1_weight[k2,k] (dcsr: k2 before k) sits in sum_k2 inside sum_k1 inside sum_k, so an
    order that puts k2 first but k1 after k scans the weight at k before k2. This mirrors the
    walk symbolically (Lowerer.walk / branch_due / advance) and checks, at every level, that
    each view reached there has its levels above it iterated already: a sparse view's in its
    storage order, a dense view's in the order's sequence (Lowerer.load lays dense views out
    that way). Computed buffers are built in walk order and need no check. With hoisting on,
    the nest is the order itself and constraints() suffices."""
    from .rexpr import Konst, Op, View, free, leaves, replace

    pos = {v: k for k, v in enumerate(order)}
    end = len(pos) + 1

    def storage(view):  # the view's levels as lower.Lowerer.load lays them out
        fmt = graph.type_of[view.tensor].format
        if fmt.is_dense or not view.plain or (fmt.block is not None and not block) or str(view) in reformat:
            return tuple(sorted(view.vars, key=pos.__getitem__))  # dense: addressed in the order
        return tuple(view.index[m].name for m in fmt.mode_order)

    def due(e, limit):
        out: list = []

        def visit(x):
            if isinstance(x, Red):
                if min(pos[r] for r in x.rvars) <= limit:
                    out.append(x)
            elif isinstance(x, Op):
                for a in x.args:
                    visit(a)

        visit(e)
        return out

    def walk(e, levels, depth):
        for idx in range(len(levels) + 1):
            limit = pos[levels[idx]] if idx < len(levels) else end
            while True:
                found = due(e, limit)
                if not found:
                    break
                x = found[0]
                sub = tuple(sorted(set(x.rvars) | (free(x) - set(depth)), key=pos.__getitem__))
                why = walk(x.body, sub, depth)
                if why:
                    return why
                e = replace(e, x, Konst(0.0))  # a value stream or a buffer in walk order
            if idx == len(levels):
                return None
            v = levels[idx]
            for view in leaves(e):
                if not isinstance(view, View):
                    continue
                vars_ = storage(view)
                if v not in vars_:
                    continue
                # a compressed level is scanned, a dense one located (parent * size + c): either
                # needs the levels above it iterated already
                missing = [u for u in vars_[:vars_.index(v)] if u not in depth]
                if missing:
                    nest = " ".join(depth + (v,))
                    return (f"with hoist=False, order {' '.join(order)} scans {view} at {v} before "
                            f"{', '.join(missing)} ({view} is stored {graph.type_of[view.tensor].format}): "
                            f"a nested reduction is computed only inside its consumer's loops "
                            f"(here the nest {nest} reaches {v} first)")
            depth = depth + (v,)
        return None

    if isinstance(expr, Red):
        body, rvars = expr.body, set(expr.rvars)
    else:
        body, rvars = expr, set()
    levels = tuple(sorted(set(out_vars) | rvars, key=pos.__getitem__))
    return walk(body, levels, ())

