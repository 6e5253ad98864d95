"""The loop nest of a fused region, as the static cost models see it.

Inside a region, index variables are unified across producers and consumers (a consumer reading
`T[k,j]` names the producer's `i` as its own `k`). A dataflow order is a sequence of the unified
variables; sparse region inputs constrain it (a compressed level can only be scanned inside the
levels above it, so CSR `A[i,k]` needs `i` before `k`) and every topological sort of those
constraints is a legal order (spec/dataflow.md, DESIGN.md).

Recomputation: a node is evaluated inside the loops its consumers in the region iterate. When the
order puts a consumer's variable `v` (one the node does not have) outside the node's innermost
variable, the node is re-evaluated for every coordinate of `v` — fusing X·W into A·(X·W)
re-computes X·W for every row of A. The multiplier is the *effective* extent of those variables:
their extents thinned by the densities of the sparse consumer operands that gate them (a row of
X·W is recomputed once per non-zero of its column of A, not once per row of A).

Hoisting (the dataflow target's `hoist` option): for the dataflow target a region is a walk of
its output's loops in the order; a producer that is a reduction is computed where the walk of
the expression it sits in reaches its first reduction variable (its *due* level), for every
coordinate of the levels walked before that; an elementwise producer is inlined and evaluated
at the innermost level of that walk. Its recomputation is the walked variables that are not its
own, thinned only by sparse operands whose variables are all walked already (a producer
computed before the walk reaches A's column level is computed for every column, not only
A's non-zeros). The two settings differ in where a nested reduction may become due:
- hoist=True: in any enclosing walk, also before the reduction it is nested in is due (into an
  on-chip buffer), so an order that puts its reduction variables first evaluates it once;
- hoist=False (FuseFlow's fully streamed recomputation): only in the walk of the reduction it is
  nested in, so it is re-evaluated whenever that one is.
- None: neither walk; every node is placed by the order alone (a GPU kernel, which runs loops
  in any order, is estimated so).
Buffered producers (the dataflow target's `buffered`: reused producers of large regions, heads
split from a QKV projection) are walks of their own, evaluated once; their consumers read the
buffer, so no recomputation reaches through them.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import networkx as nx

from ..ir.expr import Access, Call, Cast, Read
from ..ir.graph import Graph
from ..ir.index import Var, free_vars
from ..ir.unify import VarClasses

MAX_ORDERS = 16  # orders enumerated per region: enough to sweep, bounded for large regions

Density = Callable[[str, bool], float]  # (tensor, produced inside the region) -> density


@dataclass(frozen=True)
class NodeNest:
    """One node's place in a region's loop nest: the consumer variables it is recomputed over
    and the effective multiplier they give."""

    node: str
    vars: frozenset[str]  # the node's own unified variables
    recompute_vars: tuple[str, ...]
    factor: float  # effective number of re-evaluations (1.0: evaluated once per point)

    def __str__(self) -> str:
        over = ",".join(self.recompute_vars) or "-"
        return f"{self.node}: recomputed over {over} (x{self.factor:.3g})"


@dataclass(frozen=True)
class LoopNest:
    """A region under one dataflow order: per-node recomputation and the order used."""

    order: tuple[str, ...]
    nests: tuple[NodeNest, ...]
    concordant: bool  # False: no order satisfies every sparse input; some input is re-sorted
    extents: tuple[tuple[str, int], ...]

    def __str__(self) -> str:
        return f"order {'>'.join(self.order)}" + ("" if self.concordant else " (reordered input)")

    def nest_of(self, node: str) -> NodeNest:
        return next(n for n in self.nests if n.node == node)


@dataclass(frozen=True)
class RegionVars:
    """Unified variables of a region: each node's local variables mapped to unified names."""

    names: tuple[tuple[str, tuple[tuple[str, frozenset[str]], ...]], ...]  # node -> var -> unified set
    extents: tuple[tuple[str, int], ...]

    @functools.cached_property
    def _by_node(self) -> dict:  # (of() is called per node by passes over every node of a region)
        return {name: dict(local) for name, local in self.names}

    def of(self, node: str) -> dict[str, frozenset[str]]:
        return dict(self._by_node[node])

    def node_vars(self, node: str) -> frozenset[str]:
        return frozenset().union(*self.of(node).values())

    def access_vars(self, node: str, access: Access) -> frozenset[str]:
        local = self.of(node)
        return frozenset().union(*(local.get(v, frozenset()) for i in access.indices for v in free_vars(i)))


def unify(graph: Graph, nodes: Sequence[str]) -> RegionVars:
    """Link each producer's output variables to the consumer's plain index variables. A producer
    read through an affine index (`T[j, 16*i+k]`) is covered by the consumer variables of that
    index; the first consumer in graph order decides."""
    members = set(nodes)
    uf = VarClasses()
    covered: dict[tuple[str, str], frozenset] = {}
    for name in nodes:
        node = graph.node_of[name]
        for v, _ in node.dims:
            uf.find((name, v))
        for acc in node.accesses:
            if acc.tensor not in members:
                continue
            producer = graph.node_of[acc.tensor]
            for out_idx, idx in zip(producer.index, acc.indices):
                if not isinstance(out_idx, Var):
                    continue
                key = (producer.name, out_idx.name)
                if isinstance(idx, Var):
                    uf.union(key, (name, idx.name))
                elif key not in covered:
                    covered[key] = frozenset((name, v) for v in free_vars(idx))
    label = {}
    extents: dict[str, int] = {}
    for name in nodes:
        for v, size in graph.node_of[name].dims:
            root = uf.find((name, v))
            label.setdefault(root, f"{root[1]}@{root[0]}")
            extents[label[root]] = max(extents.get(label[root], 1), size)

    def resolve(key, depth=0):
        if key in covered and depth < 8:
            return frozenset().union(*(resolve(k, depth + 1) for k in covered[key]))
        return frozenset((label[uf.find(key)],))

    names = tuple((name, tuple((v, resolve((name, v))) for v, _ in graph.node_of[name].dims)) for name in nodes)
    return RegionVars(names, tuple(sorted(extents.items())))


def order_constraints(graph: Graph, nodes: Sequence[str], rv: RegionVars) -> nx.DiGraph:
    """Edges u -> v: u must be outside v. Only compressed levels of tensors read from memory
    constrain the order; dense levels are located directly, in any order."""
    members = set(nodes)
    dag = nx.DiGraph()
    dag.add_nodes_from(name for name, _ in rv.extents)
    for name in nodes:
        for acc in graph.node_of[name].accesses:
            if acc.tensor in members or acc.tensor not in graph.type_of:
                continue
            fmt = graph.type_of[acc.tensor].format
            if fmt.rank != len(acc.indices):
                continue
            local = rv.of(name)
            level_vars = [frozenset().union(*(local.get(v, frozenset()) for v in free_vars(acc.indices[m])))
                          for m in fmt.mode_order]
            for k, kind in enumerate(fmt.levels):
                if kind.value != "c":
                    continue
                for outer in level_vars[:k]:
                    for u, v in itertools.product(outer, level_vars[k]):
                        if u != v:
                            dag.add_edge(u, v)
    return dag


def legal_orders(graph: Graph, nodes: Sequence[str], rv: RegionVars | None = None,
                 limit: int = MAX_ORDERS, constrained: bool = True) -> tuple[tuple[tuple[str, ...], ...], bool]:
    """Up to `limit` legal dataflow orders, the canonical one first (variables in the order the
    region's nodes introduce them), and whether they satisfy every sparse input (concordant).
    `constrained=False` ignores storage orders (a GPU kernel may read in any order)."""
    rv = rv or unify(graph, nodes)
    dag = order_constraints(graph, nodes, rv)
    concordant = nx.is_directed_acyclic_graph(dag)
    if not concordant or not constrained:  # unconstrained; a non-concordant input gets re-sorted
        dag = nx.DiGraph()
        dag.add_nodes_from(name for name, _ in rv.extents)
    first_seen: dict[str, int] = {}
    for name in nodes:
        for _, unified in rv.of(name).items():
            for u in sorted(unified):
                first_seen.setdefault(u, len(first_seen))
    rank = {u: (first_seen.get(u, 0), u) for u in dag}
    canonical = tuple(nx.lexicographical_topological_sort(dag, key=rank.__getitem__) if not nx.is_empty(dag)
                      else sorted(dag, key=rank.__getitem__))
    orders = [canonical] + [o for o in _topological_sorts(dag, rank, limit) if o != canonical]
    orders = orders[:limit]
    # then orders that start from the outputs (consumers' variables first, as a streamed walk
    # nests them): where a nested reduction is reached late, its consumers' sparse operands
    # are walked already and thin its recomputation
    last_seen: dict[str, int] = {}
    for name in reversed(list(nodes)):
        for _, unified in rv.of(name).items():
            for u in sorted(unified):
                last_seen.setdefault(u, len(last_seen))
    outward = {u: (last_seen.get(u, 0), u) for u in dag}
    orders += [o for o in _topological_sorts(dag, outward, limit) if o not in orders]
    # and one with every reduction's variables first, producers' before consumers': nested
    # reductions then fall due before their consumers' loops and are buffered once (hoisting)
    reduced: dict[str, int] = {}
    for name in nodes:
        node = graph.node_of[name]
        if node.reduce_vars and not node.is_scatter:
            for v in node.reduce_vars:
                for u in sorted(rv.of(name)[v]):
                    reduced.setdefault(u, len(reduced))
    hoisting = {u: (reduced.get(u, len(reduced)), first_seen.get(u, 0), u) for u in dag}
    orders += [o for o in _topological_sorts(dag, hoisting, 1) if o not in orders]
    return tuple(orders), concordant


def _topological_sorts(dag: nx.DiGraph, rank, limit: int) -> list[tuple[str, ...]]:
    """The first `limit` topological sorts in lexicographic order of `rank` (depth-first)."""
    names = sorted(dag, key=rank.__getitem__)
    if nx.is_empty(dag):  # (dense operands: every permutation, lexicographic order is itertools')
        return list(itertools.islice(itertools.permutations(names), limit))
    preds = {u: set(dag.predecessors(u)) for u in dag}
    out: list[tuple[str, ...]] = []
    prefix: list[str] = []
    placed: set[str] = set()

    def walk():
        if len(out) >= limit:
            return
        if len(prefix) == len(names):
            out.append(tuple(prefix))
            return
        for u in names:
            if u not in placed and preds[u] <= placed:
                prefix.append(u)
                placed.add(u)
                walk()
                placed.discard(u)
                prefix.pop()
                if len(out) >= limit:
                    return

    walk()
    return out


def downstream(graph: Graph, nodes: Sequence[str]) -> dict[str, frozenset[str]]:
    """For each region node, the region nodes that consume it, directly or transitively."""
    members = set(nodes)
    result: dict[str, set] = {n: set() for n in nodes}
    for name in reversed([n.name for n in graph.nodes if n.name in members]):
        for c in graph.consumers.get(name, ()):
            if c in members:
                result[name] |= {c} | result[c]
    return {k: frozenset(v) for k, v in result.items()}


def gating_accesses(body) -> tuple[Access, ...]:
    """Accesses in multiplicative position: the node's value is zero where they are zero, so the
    node only iterates where they are non-zero (an intersection in the dataflow graph)."""
    if isinstance(body, Read):
        return (body.access,)
    if isinstance(body, Cast):
        return gating_accesses(body.arg)
    if isinstance(body, Call):
        if body.op in ("mul", "and"):
            return tuple(a for arg in body.args for a in gating_accesses(arg))
        if body.op == "div":
            return gating_accesses(body.args[0])
    return ()


@dataclass(frozen=True)
class Prepared:
    """The order-independent part of a region's analysis, computed once per region: for each
    node its unified variables, those of its consumers in the region, and the gating accesses
    (tensor, unified variables, density) of those consumers."""

    rows: tuple[tuple[str, frozenset, frozenset, tuple], ...]
    extents: tuple[tuple[str, int], ...]
    reduction_vars: tuple[tuple[str, frozenset], ...] = ()  # reductions -> their unified reduction variables
    consumers: tuple[tuple[str, tuple[str, ...]], ...] = ()  # node -> its direct consumers in the region
    buffered: frozenset[str] = frozenset()  # nodes written once on chip: their own walks, never recomputed


def prepare(graph: Graph, nodes: Sequence[str], rv: RegionVars, density: Density,
            buffered: frozenset[str] = frozenset()) -> Prepared:
    members = set(nodes)
    position = {n.name: k for k, n in enumerate(graph.nodes)}
    nodes = sorted(nodes, key=position.__getitem__)  # producers before consumers (_walk relies on it)
    below = downstream(graph, nodes)
    own = {name: rv.node_vars(name) for name in nodes}
    gates = {}
    for name in nodes:
        found = []
        for acc in gating_accesses(graph.node_of[name].body):
            if acc.tensor not in members:
                found.append((acc.tensor, rv.access_vars(name, acc), density(acc.tensor, False)))
        gates[name] = found
    rows = []
    for name in nodes:
        users = frozenset().union(*(own[c] for c in below[name]))
        guards = {(t, u): d for c in below[name] for t, u, d in gates[c]}
        rows.append((name, own[name], users, tuple((t, u, d) for (t, u), d in guards.items())))
    reductions = []
    for n in nodes:
        node = graph.node_of[n]
        if node.reduce_vars and not node.is_scatter:
            local = rv.of(n)
            reductions.append((n, frozenset().union(*(local[v] for v in node.reduce_vars))))
    direct = tuple((n, tuple(c for c in graph.consumers.get(n, ()) if c in members)) for n in nodes)
    return Prepared(tuple(rows), rv.extents, tuple(reductions), direct, frozenset(buffered) & members)


def _factor(recompute: Sequence[str], own: frozenset, guards, ext: Mapping[str, int], walked=None) -> float:
    """Effective re-evaluations over `recompute`: extents thinned by the gating densities of
    sparse operands over those variables (with `walked`: only operands whose variables are all
    walked already)."""
    factor = 1.0
    if recompute:
        rset = set(recompute)
        enclosing = walked if walked is not None else own | rset
        for u in recompute:
            factor *= ext[u]
        for _, uvars, d in guards:
            if uvars <= enclosing and uvars & rset:
                factor *= d
    return factor


def analyse(prep: Prepared, order: Sequence[str], concordant: bool = True, hoist: bool | None = None) -> LoopNest:
    """Per-node recomputation factors of a region under `order`: by the walk of the dataflow
    target with hoisting on or off, or (hoist=None) by the order alone (module docstring)."""
    pos = {u: k for k, u in enumerate(order)}
    ext = dict(prep.extents)
    if hoist is None:
        placed = {name: _by_order(own, users, pos, order) for name, own, users, _ in prep.rows}
    else:
        placed = _walk(prep, pos, bool(hoist))
    nests = []
    for name, own, _, guards in prep.rows:
        walked = placed[name]
        recompute = tuple(u for u in order if u in walked and u not in own) if hoist is not None else walked
        factor = _factor(recompute, own, guards, ext, walked if hoist is not None else None)
        nests.append(NodeNest(name, own, recompute, factor))
    return LoopNest(tuple(order), tuple(nests), concordant, prep.extents)


def walk_roots(prep: Prepared) -> dict[str, frozenset[str]]:
    """For each node, the walks that evaluate it, named by their roots: a buffered node and a
    node no other region node reads are roots (walks of their own); any other node is evaluated
    in the walks of its consumers."""
    consumers = dict(prep.consumers)
    roots: dict[str, frozenset[str]] = {}
    for name, _, _, _ in reversed(prep.rows):  # consumers first
        users = consumers.get(name, ())
        if name in prep.buffered or not users:
            roots[name] = frozenset((name,))
        else:
            roots[name] = frozenset().union(*(roots[c] for c in users))
    return roots


def analyse_walks(prep: Prepared, orders_of: Callable[[Sequence[str]], Sequence[tuple[str, ...]]],
                  concordant: bool, hoist: bool, weight: Mapping[str, float]) -> LoopNest:
    """A region with buffered nodes, as the dataflow target lowers it: every walk (each buffered
    node, each output) takes its own order, here the one of `orders_of(walk's nodes)` under which
    the walk's nodes do the least `weight`-ed work. A node in several walks keeps its largest
    recomputation. The LoopNest's order is that of the walk of the region's last node."""
    roots = walk_roots(prep)
    members: dict[str, list[str]] = {}
    for name, rs in roots.items():
        for r in rs:
            members.setdefault(r, []).append(name)
    chosen: dict[str, tuple] = {}
    for r, ns in members.items():
        best = None
        local = _placing(prep, ns)
        seen, relevant = {}, _variables(local)
        for order in orders_of(ns):
            # orders that place the walk's variables alike place its nodes alike: analysed once
            key = tuple(u for u in order if u in relevant)
            if key not in seen:
                found = {nn.node: nn for nn in analyse(local, order, concordant, hoist).nests}
                seen[key] = (sum(weight[n] * found[n].factor for n in ns), found)
            work, found = seen[key]
            if best is None or work < best[0]:
                best = (work, order, found)
        chosen[r] = best
    nests = tuple(max((chosen[r][2][name] for r in roots[name]), key=lambda nn: nn.factor)
                  for name, _, _, _ in prep.rows)
    last = prep.rows[-1][0]
    return LoopNest(tuple(chosen[next(iter(roots[last]))][1]), nests, concordant, prep.extents)


def _placing(prep: Prepared, names) -> Prepared:
    """`prep` cut to what places `names` in a walk: they and their consumers, transitively, up to
    buffered nodes (which start walks of their own). Their nests are the whole region's, at a cost
    of the walk's size, not the region's, for each order tried (regions of hundreds of nodes have
    hundreds of walks)."""
    consumers = dict(prep.consumers)
    keep, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            if name not in prep.buffered:
                todo.extend(consumers.get(name, ()))
    if len(keep) == len(prep.rows):
        return prep
    return Prepared(tuple(r for r in prep.rows if r[0] in keep), prep.extents,
                    tuple(r for r in prep.reduction_vars if r[0] in keep),
                    tuple(c for c in prep.consumers if c[0] in keep), prep.buffered & keep)


def _variables(prep: Prepared) -> frozenset[str]:
    """Every variable the analysis of `prep`'s nodes looks at (its result depends on the order
    only through their positions)."""
    found = set()
    for _, own, users, guards in prep.rows:
        found |= own | users
        for _, uvars, _ in guards:
            found |= uvars
    for _, reduced in prep.reduction_vars:
        found |= reduced
    return frozenset(found)


def _by_order(own, users, pos, order) -> tuple[str, ...]:
    """Consumer variables the order puts outside the node's innermost variable."""
    inner = max((pos[u] for u in own), default=-1)
    return tuple(u for u in order if pos[u] < inner and u in users and u not in own)


@dataclass(frozen=True)
class _Walk:
    """The loops of one reduction (or region output) as the target walks them: the variables
    walked before it starts, its own levels in order, and how far this walk got before the next
    inner one became due (where a hoisted reduction can still be placed)."""

    depth: frozenset
    levels: tuple[str, ...]
    reach: int


def _walk(prep: Prepared, pos, hoist: bool) -> dict[str, frozenset]:
    """For each node, the variables walked when it is evaluated (see the module docstring).
    Consumers are placed first; a node with several consumers takes the deepest placement
    (its copies are evaluated in each; the largest dominates). A buffered node is a walk of its
    own, as a region output is: its consumers read the buffer."""
    own = {name: vars_ for name, vars_, _, _ in prep.rows}
    rvars = dict(prep.reduction_vars)
    consumers = {name: () if name in prep.buffered else users for name, users in prep.consumers}
    sees: dict[str, tuple[_Walk, ...]] = {}  # walks a node's expression appears in, outermost first
    walked: dict[str, frozenset] = {}
    for name, _, _, _ in reversed(prep.rows):  # graph order reversed: consumers first
        options = [sees[c] for c in consumers.get(name, ())] or [()]
        best = None
        for chain in options:
            depth, inner = _place(name in rvars, rvars.get(name, frozenset()), chain, pos, hoist)
            if best is None or len(depth - own[name]) > len(best[0] - own[name]):
                best = (depth, inner)
        depth, chain = best
        walked[name] = depth
        if name in rvars or not consumers.get(name):
            levels = tuple(sorted(own[name] - depth, key=pos.__getitem__))
            chain = chain + (_Walk(depth, levels, len(levels)),)
        sees[name] = chain
    return walked


def _place(is_reduction: bool, reduction_vars: frozenset, chain: tuple, pos, hoist: bool):
    """(walked variables, enclosing walks) where a node appearing in the walks `chain` is
    evaluated: an elementwise node at the innermost level of the innermost walk; a reduction at
    its due level (the first whose position reaches its first reduction variable), searched in
    the enclosing walks too when hoisting."""
    if not chain:
        return frozenset(), ()
    last = chain[-1]
    if not is_reduction:
        return last.depth | frozenset(last.levels), chain
    first = min(pos[u] for u in reduction_vars)
    for k in range(0 if hoist else len(chain) - 1, len(chain)):
        w = chain[k]
        for idx in range(w.reach + 1 if k < len(chain) - 1 else len(w.levels) + 1):
            if idx == len(w.levels) or first <= pos[w.levels[idx]]:
                if k < len(chain) - 1 and idx == w.reach:
                    break  # the next inner walk is due here first: look inside it
                return w.depth | frozenset(w.levels[:idx]), chain[:k] + (_Walk(w.depth, w.levels, idx),)
    raise AssertionError("unreachable: the innermost walk always places the node")


def lane_count(order: Sequence[str], extents: Mapping[str, int], par: Mapping) -> int:
    """Parallel lanes: `par` maps a variable name (as the dataflow target's options do: the
    outermost unified variable of that name forks) or a loop level (0 = outermost) to a fork
    width; a fork cannot use more lanes than its variable has coordinates, and nested forks
    multiply (4 x 4 -> 16 lanes)."""
    lanes = 1
    for where, width in (par or {}).items():
        if isinstance(where, str) and not where.isdigit():
            var = next((u for u in order if u.split("@")[0] == where), None)
        else:
            var = order[int(where)] if 0 <= int(where) < len(order) else None
        if var is not None:
            lanes *= max(1, min(int(width), extents[var]))
    return lanes
