"""Fusion plans: an exact integer program over candidate regions, or a fast heuristic.

Integer program (FusionStitching's formulation, solved with scipy.optimize.milp / HiGHS): one
binary per legal candidate region, each node covered exactly once, minimum total cost. Each
candidate is convex, but two chosen regions may still depend on each other both ways; such
cycles are cut lazily: solve, look for a cycle among the chosen regions, forbid choosing all of
them together, solve again.

Heuristic (large graphs): dynamic programming over a topological order — the best split of the
order into connected contiguous slices (each slice of a topological order is convex, and the
slices run in order, so no cycle can arise); exact on chains. It is run on two orders (graph
order and a chain-keeping order), the better result is then improved by merging neighbouring
regions while the cost falls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import networkx as nx
import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix

from ..ir.errors import StitchflowError
from ..ir.graph import Graph, Region
from .candidates import Legality, Masks, Refusal, chain_order, enumerate_candidates
from .cost import STRUCTURAL, Estimate, model_for, region_density
from .regionkey import RegionKeys
from .regions import ordered_regions

ILP_MAX_NODES = 64  # above this the heuristic plans: candidate sets and solve times grow fast
MAX_CUTS = 500  # lazy cycle cuts before giving up on the integer program
SLICE_MAX_NODES = 16  # longest slice the heuristic's dynamic program considers


@dataclass(frozen=True)
class Plan:
    regions: tuple[Region, ...]
    cost: float
    method: str  # "ilp" | "heuristic"
    reasons: tuple[str, ...]  # refused candidates and notes, one line each
    estimates: tuple[Estimate, ...] = field(default=(), compare=False)

    def __str__(self) -> str:
        return f"plan by {self.method}: {len(self.regions)} regions, cost {self.cost:.6g}"

    @property
    def groups(self) -> list[list[str]]:
        return [list(r.nodes) for r in self.regions]


# (model, options) -> region key -> (cost, estimate): a model's partitions between eager ops (ResNet's backward
# is 17 graphs of four kinds of block) are mostly the same regions under other names, so graphs planned one after
# another share their estimates; regionkey's ids are process-wide for this
_SHAPES: dict[tuple, dict[tuple, tuple[float, Estimate]]] = {}
MAX_SHAPES = 1 << 16  # estimates kept per model and options before the table starts again


def _shared_estimates(model, options: dict) -> dict:
    """The process-wide estimates by structure for `model` and `options` (a dict of this Costs' own
    where either cannot be a key)."""
    try:
        key = (model, tuple(sorted(options.items())))
        hash(key)
    except TypeError:
        return {}
    if key not in _SHAPES and len(_SHAPES) >= 64:  # e.g. many sparse graphs, each with its own densities
        _SHAPES.clear()
    return _SHAPES.setdefault(key, {})


class Costs:
    """Region costs under one model and options, memoised by node set, and for the static
    models also by structure: regions equal up to names (a model's repeated layers) are
    estimated once (regionkey.py)."""

    def __init__(self, graph: Graph, model, options: Mapping | None = None):
        self.graph, self.model, self.options = graph, model, dict(options or {})
        # node set -> (cost, estimate, names): the estimate may be of another region with the same
        # key, renamed to `names` only when asked for (the DP reads thousands of costs, few estimates)
        self._memo: dict[frozenset, tuple[float, Estimate, tuple[str, ...]]] = {}
        self._order = {n.name: k for k, n in enumerate(graph.nodes)}
        self._keys = None
        if type(model) in STRUCTURAL:
            self._keys = RegionKeys(graph, region_density(graph, model.densities, self.options.get("block")))
        self._shapes = _shared_estimates(model, self.options) if self._keys else {}

    def of(self, nodes: Sequence[str]) -> float:
        return self._entry(frozenset(nodes))[0]

    def estimate(self, nodes: Sequence[str]) -> Estimate:
        key = frozenset(nodes)
        cost, est, names = self._entry(key)
        if self._keys is not None and est.nodes != names:
            est = self._keys.renamed(est, names)
            self._memo[key] = (cost, est, names)
        return est

    def entry(self, nodes: Sequence[str]) -> tuple[float, Estimate]:
        return self.of(nodes), self.estimate(nodes)

    def _entry(self, key: frozenset) -> tuple[float, Estimate, tuple[str, ...]]:
        if key not in self._memo:
            names = tuple(sorted(key, key=self._order.__getitem__))
            self._memo[key] = (*self._estimate(names), names)
        return self._memo[key]

    def _estimate(self, names: tuple[str, ...]) -> tuple[float, Estimate]:
        if self._keys is None:
            est = self.model.estimate(self.graph, names, self.options)
            return self.model.cost(est), est
        shape = self._keys.key(names)
        hit = self._shapes.get(shape)
        if hit is None:
            if len(self._shapes) >= MAX_SHAPES:
                self._shapes.clear()
            est = self.model.estimate(self.graph, names, self.options)
            hit = self._shapes[shape] = (self.model.cost(est), est)
        return hit


def _quotient_cycle(graph: Graph, groups: Sequence[Sequence[str]]) -> list[int] | None:
    owner = {n: g for g, names in enumerate(groups) for n in names}
    q = nx.DiGraph()
    q.add_nodes_from(range(len(groups)))
    for n in graph.nodes:
        for p in graph.producers(n):
            if owner[p] != owner[n.name]:
                q.add_edge(owner[p], owner[n.name])
    try:
        return sorted({a for a, _ in nx.find_cycle(q)})
    except nx.NetworkXNoCycle:
        return None


def solve_ilp(graph: Graph, regions: Sequence[tuple[str, ...]], costs: Costs,
              excluded: Sequence[Sequence[tuple[str, ...]]] = ()) -> tuple[list[tuple[str, ...]], float, int]:
    """Exact cover of the nodes by `regions` at minimum cost, with lazy cycle cuts; the plans in
    `excluded` (lists of regions) are forbidden by no-good cuts (k-best plans).
    Returns (chosen regions, cost, cuts added)."""
    names = [n.name for n in graph.nodes]
    index = {n: k for k, n in enumerate(names)}
    regions = list(regions)
    covered = {n for r in regions for n in r}
    if covered != set(names):
        missing = sorted(set(names) - covered, key=index.__getitem__)
        raise StitchflowError(f"no legal region contains {missing}: the target refuses even these nodes alone")
    raw = np.array([costs.of(r) for r in regions])
    # HiGHS stops within an absolute gap of 1e-6 (scipy passes no option for it): with the largest cost scaled to
    # 1 it returned a plan 2e-7 (relative) over the optimum; scaled to 1e6 the gap is 1e-12 of the largest cost
    c = raw * (1e6 / max(float(np.abs(raw).max()), 1e-300))
    cover = lil_matrix((len(names), len(regions)))
    for j, r in enumerate(regions):
        for n in r:
            cover[index[n], j] = 1
    constraints = [LinearConstraint(cover.tocsr(), 1, 1)]
    position = {frozenset(r): j for j, r in enumerate(regions)}
    for plan_ in excluded:  # an exact cover is fixed by its regions: forbid choosing all of them
        if all(frozenset(r) in position for r in plan_):
            row = np.zeros(len(regions))
            row[[position[frozenset(r)] for r in plan_]] = 1
            constraints.append(LinearConstraint(row[None, :], -np.inf, row.sum() - 1))
    cuts: list[np.ndarray] = []
    for _ in range(MAX_CUTS + 1):
        cons = constraints + ([LinearConstraint(np.array(cuts), -np.inf, [row.sum() - 1 for row in cuts])] if cuts else [])
        res = milp(c, constraints=cons, integrality=np.ones(len(regions)), bounds=Bounds(0, 1),
                   options={"mip_rel_gap": 0.0})
        if res.x is None:
            raise StitchflowError(f"the integer program has no solution: {res.message}")
        chosen = [j for j in range(len(regions)) if res.x[j] > 0.5]
        cycle = _quotient_cycle(graph, [regions[j] for j in chosen])
        if cycle is None:
            return [regions[j] for j in chosen], float(sum(raw[j] for j in chosen)), len(cuts)
        row = np.zeros(len(regions))
        row[[chosen[k] for k in cycle]] = 1
        cuts.append(row)
    raise StitchflowError(f"the integer program still had a cycle between regions after {MAX_CUTS} cuts")


def _slice_dp(order: Sequence[str], masks: Masks, legal, costs: Costs, width: int):
    """Best split of `order` into connected, legal contiguous slices (dynamic programming)."""
    n = len(order)
    best = [0.0] + [float("inf")] * n
    back = [0] * (n + 1)
    for end in range(1, n + 1):
        m = 0
        for start in range(end - 1, max(-1, end - 1 - width), -1):
            m |= 1 << masks.index[order[start]]
            nodes = order[start:end]
            if best[start] == float("inf") or not masks.connected(m) or not legal(nodes):
                continue
            total = best[start] + costs.of(nodes)
            if total < best[end]:
                best[end], back[end] = total, start
    if best[n] == float("inf"):
        raise StitchflowError("no split of the graph into legal regions: the target refuses single nodes")
    groups, end = [], n
    while end > 0:
        groups.append(list(order[back[end]:end]))
        end = back[end]
    return groups[::-1], best[n]


def _merge_pass(graph: Graph, groups: list[list[str]], masks: Masks, legal, costs: Costs):
    """Greedy: merge the pair of neighbouring regions with the largest cost saving, repeat.
    The target is asked only about the merge about to be made (its checks can be slow)."""
    while True:
        owner = {n: g for g, names in enumerate(groups) for n in names}
        pairs = {tuple(sorted((owner[p], owner[n.name]))) for n in graph.nodes for p in graph.producers(n)
                 if owner[p] != owner[n.name]}
        gains = []
        for a, b in pairs:
            merged = groups[a] + groups[b]
            gain = costs.of(groups[a]) + costs.of(groups[b]) - costs.of(merged)
            if gain > 1e-12 * max(1.0, abs(costs.of(merged))) and masks.convex(masks.of(merged)):
                gains.append((gain, a, b))
        for _, a, b in sorted(gains, reverse=True):
            trial = [g for k, g in enumerate(groups) if k not in (a, b)] + [groups[a] + groups[b]]
            if _quotient_cycle(graph, trial) is None and legal(groups[a] + groups[b]):
                groups = trial
                break
        else:
            return groups


def solve_heuristic(graph: Graph, legality: Legality, costs: Costs, width: int = SLICE_MAX_NODES):
    masks = Masks(graph)
    order_of = {n: k for k, n in enumerate(masks.names)}

    def key(nodes):
        return tuple(sorted(nodes, key=order_of.__getitem__))

    def legal(nodes):
        return legality.check(graph, key(nodes)) is None

    refused: set = set()
    while True:  # lazy legality: split by cost, ask the target about the chosen slices only
        results = [_slice_dp(order, masks, lambda n: key(n) not in refused, costs, width)
                   for order in (masks.names, chain_order(graph))]
        groups = min(results, key=lambda r: r[1])[0]
        bad = {key(g) for g in groups if not legal(g)}
        if not bad:
            break
        refused |= bad
    groups = _merge_pass(graph, groups, masks, legal, costs)
    return groups, sum(costs.of(g) for g in groups)


def _lazy_ilp(graph: Graph, legality: Legality, costs: Costs, excluded=()):
    """The integer program with lazy legality: solve over every connected convex candidate,
    ask the target about the chosen regions only, drop refused ones and solve again. The result
    is optimal over the legal candidates (it is optimal over a superset of them and legal), and
    the target is asked about a handful of regions instead of all of them."""
    cands = enumerate_candidates(graph, None)
    refused: list[Refusal] = []
    dropped: set = set()
    while True:
        groups, total, cuts = solve_ilp(graph, [c for c in cands.legal if c not in dropped], costs, excluded)
        bad = [Refusal(tuple(g), why) for g in groups if (why := legality.check(graph, tuple(g)))]
        if not bad:
            return groups, total, cuts, cands, refused
        refused += bad
        dropped |= {r.nodes for r in bad}


def plan(graph: Graph, target="reference", cost_model=None, options: Mapping | None = None,
         method: str = "auto", ilp_max_nodes: int = ILP_MAX_NODES) -> Plan:
    """Choose fusion regions for `graph` on `target` (a name or an object with check_region)
    minimising `cost_model` (default: the target's static model with assumed densities).
    method: "ilp", "heuristic" or "auto" (the integer program up to `ilp_max_nodes` nodes)."""
    legality = target if isinstance(target, Legality) else Legality(target)
    model = cost_model or model_for(legality.name)
    costs = Costs(graph, model, options)
    if not graph.nodes:  # e.g. a torch.compile partition whose ops all became inputs or views
        return Plan((), 0.0, method, ("nothing to plan: the graph has no nodes",))
    if method == "auto":
        method = "ilp" if len(graph.nodes) <= ilp_max_nodes else "heuristic"
    notes = [legality.note] if legality.note else []
    if method == "ilp":
        groups, total, cuts, cands, refused = _lazy_ilp(graph, legality, costs)
        notes += [f"{cands}; {len(refused)} refused by the target; {cuts} cycle cut(s)"]
        notes += [f"refused {r}" for r in refused]
    elif method == "heuristic":
        groups, total = solve_heuristic(graph, legality, costs)
        notes.append("heuristic: slices of a topological order, then greedy merging")
    else:
        raise StitchflowError(f"unknown planning method {method!r}; use ilp, heuristic or auto")
    regions = ordered_regions(graph, groups)
    why = f"chosen by {method}: lowest {getattr(model, 'unit', 'cost')}"
    regions = tuple(Region(r.name, r.nodes, why) for r in regions)
    return Plan(regions, total, method, tuple(notes), tuple(costs.estimate(r.nodes) for r in regions))


def k_best(graph: Graph, target="reference", cost_model=None, k: int = 3, options: Mapping | None = None) -> list[Plan]:
    """The `k` cheapest plans of the integer program, best first: each next one is solved with
    no-good cuts forbidding the plans found so far (FlashFuser's "rank by the analytical model,
    then measure the best few"). Fewer when the candidates admit fewer partitions; on graphs
    too large for the integer program, the heuristic's single plan."""
    first = plan(graph, target, cost_model, options)
    plans = [first]
    if first.method != "ilp":
        return plans
    legality = target if isinstance(target, Legality) else Legality(target)
    model = cost_model or model_for(legality.name)
    costs = Costs(graph, model, options)
    while len(plans) < k:
        try:
            groups, total, _, _, _ = _lazy_ilp(graph, legality, costs, [p.groups for p in plans])
        except StitchflowError:  # infeasible: every partition over the candidates is taken
            break
        regions = ordered_regions(graph, groups)
        why = f"chosen by ilp: plan {len(plans) + 1} by {getattr(model, 'unit', 'cost')}"
        regions = tuple(Region(r.name, r.nodes, why) for r in regions)
        plans.append(Plan(regions, total, "ilp", (f"k-best: {len(plans)} plan(s) excluded",),
                          tuple(costs.estimate(r.nodes) for r in regions)))
    return plans


def partition_cost(graph: Graph, groups: Sequence[Sequence[str]], cost_model, options=None) -> float:
    """Cost of a given partition under a model (for comparisons and tests)."""
    costs = Costs(graph, cost_model, options)
    return sum(costs.of(g) for g in groups)
