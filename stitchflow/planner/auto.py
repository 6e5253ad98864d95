"""The automatic plan (`fusion="auto"`): the integer program of ilp.py (the heuristic on large
graphs) under the target's static cost model, densities measured from the parameter values
when given. Plans are memoised per graph, target and values, since explain() asks again.

`auto_candidates` is what exploration measures before it names a plan "auto" (FlashFuser's
"analytical model, then profile the best few"): the k best plans of the integer program under
the static model with each of the loop-nest assumptions of loopnest.py — hoisting (the dataflow
target's default: a nested reduction may be buffered on chip), streaming (hoist=False), and
placement by the order alone. Whether the target hoists depends on the dataflow order it picks
by its own estimate, which the planner does not decide, so the plans that are best under each
assumption are measured and the fastest kept.

Plans of a target named by a string are also kept on disk (plan_cache.py), keyed by the graph, the target,
the densities and the package's source: a model compiled again in a new process is not planned again."""

from __future__ import annotations

from typing import Mapping

from ..ir.graph import Graph, Region
from .candidates import Legality
from .cost import model_for
from . import plan_cache
from .ilp import Costs, Plan, k_best, plan
from .regions import by_layer, by_origin, ordered_regions
from .stats import measure

_PLANS: dict = {}  # (id(graph), target, id(values)) -> (graph, values, plan)


def auto_plan(graph: Graph, target: str = "reference", values: Mapping | None = None) -> Plan:
    key = (id(graph), target if isinstance(target, str) else id(target), id(values))
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is graph and hit[1] is values:
        return hit[2]
    result = _planned(graph, target, measure(graph, values))
    if len(_PLANS) > 32:
        _PLANS.clear()
    _PLANS[key] = (graph, values, result)
    return result


def _planned(graph: Graph, target, densities) -> Plan:
    """The plan made for the same graph, target and densities by an earlier process (plan_cache.py), else
    made now and kept. A target given as an object (tests' legality stand-ins) is planned every time."""
    if not (isinstance(target, str) and plan_cache.enabled()):
        return plan(graph, target, model_for(target if isinstance(target, str) else "reference", densities))
    key = plan_cache.plan_key(graph, target, densities)
    made = plan_cache.load(key)
    if made is None:
        made = plan(graph, target, model_for(target, densities))
        plan_cache.store(key, made)
    return made


def auto_groups(graph: Graph, target: str = "reference", values: Mapping | None = None) -> list[list[str]]:
    return auto_plan(graph, target, values).groups


AUTO_CANDIDATES = 2  # plans per loop-nest assumption that exploration measures
# Between two configurations the static dataflow model's cycle ratio was off by up to 1.35x on
# the simulator (GCN on Cora, prune.py): a plan whose estimate is within that factor of the
# best one's may still be the fastest, so exploration measures it too.
MODEL_MARGIN = 1.35
ASSUMPTIONS = (("hoisted", True), ("streamed", False), ("ordered", None))  # options["hoist"] for loopnest


def auto_candidates(graph: Graph, target: str = "reference", values: Mapping | None = None,
                    k: int = AUTO_CANDIDATES, margin: float = MODEL_MARGIN) -> list[tuple[str, Plan]]:
    """[(label, plan)]: the k best plans under each loop-nest assumption, and the standard
    granularities (unfused, per layer, full) whose estimate under that assumption is within
    `margin` of the best plan's; each partition once (labelled by the first that ranked it)."""
    model = model_for(target if isinstance(target, str) else "reference", measure(graph, values))
    legality = target if isinstance(target, Legality) else Legality(target)
    out: list[tuple[str, Plan]] = []
    seen: set = set()

    def add(label: str, p: Plan) -> None:
        key = frozenset(frozenset(g) for g in p.groups)
        if key not in seen:
            seen.add(key)
            out.append((label, p))

    for label, hoist in ASSUMPTIONS:
        plans = k_best(graph, target, model, k, {"hoist": hoist})
        for rank, p in enumerate(plans, 1):
            add(f"{label} #{rank}", p)
        for name, groups in standard_partitions(graph):
            if any(legality.check(graph, g) for g in groups):
                continue
            p = named_plan(graph, groups, model, {"hoist": hoist}, name)
            if p.cost <= plans[0].cost * margin:
                add(f"{label} {name} (within {margin:g}x)", p)
    return out


def standard_partitions(graph: Graph) -> list[tuple[str, list[list[str]]]]:
    return [("unfused", by_origin(graph)), ("per-layer", by_layer(graph)), ("full", [[n.name for n in graph.nodes]])]


def named_plan(graph: Graph, groups, model, options: Mapping, name: str) -> Plan:
    """A given partition as a plan, costed by the model like the integer program's."""
    costs = Costs(graph, model, options)
    regions = tuple(Region(r.name, r.nodes, f"{name}: within the model's error of the best plan")
                    for r in ordered_regions(graph, groups))
    return Plan(regions, sum(costs.of(r.nodes) for r in regions), "named", (name,),
                tuple(costs.estimate(r.nodes) for r in regions))
