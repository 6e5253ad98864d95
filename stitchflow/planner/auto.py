"""The automatic plan (`fusion="auto"`): the integer program of ilp.py (the heuristic on large
graphs) under the target's static cost model, densities measured from the parameter values
when given. Plans are memoised per graph, target and values, since explain() asks again.

`auto_candidates` is what exploration measures before it names a plan "auto" (FlashFuser's
"analytical model, then profile the best few"): the k best plans of the integer program under
the static model with each of the loop-nest assumptions of loopnest.py — hoisting (the dataflow
target's default: a nested reduction may be buffered on chip), streaming (hoist=False), and
placement by the order alone. Whether the target hoists depends on the dataflow order it picks
by its own estimate, which the planner does not decide, so the plans that are best under each
assumption are measured and the fastest kept."""

from __future__ import annotations

from typing import Mapping

from ..ir.graph import Graph
from .cost import model_for
from .ilp import Plan, k_best, plan
from .stats import measure

_PLANS: dict = {}  # (id(graph), target, id(values)) -> (graph, values, plan)


def auto_plan(graph: Graph, target: str = "reference", values: Mapping | None = None) -> Plan:
    key = (id(graph), target if isinstance(target, str) else id(target), id(values))
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is graph and hit[1] is values:
        return hit[2]
    model = model_for(target if isinstance(target, str) else "reference", measure(graph, values))
    result = plan(graph, target, model)
    if len(_PLANS) > 32:
        _PLANS.clear()
    _PLANS[key] = (graph, values, result)
    return result


def auto_groups(graph: Graph, target: str = "reference", values: Mapping | None = None) -> list[list[str]]:
    return auto_plan(graph, target, values).groups


AUTO_CANDIDATES = 2  # plans per loop-nest assumption that exploration measures
ASSUMPTIONS = (("hoisted", True), ("streamed", False), ("ordered", None))  # options["hoist"] for loopnest


def auto_candidates(graph: Graph, target: str = "reference", values: Mapping | None = None,
                    k: int = AUTO_CANDIDATES) -> list[tuple[str, Plan]]:
    """[(label, plan)]: the k best plans under each loop-nest assumption, each partition once
    (labelled by the first assumption that ranked it)."""
    model = model_for(target if isinstance(target, str) else "reference", measure(graph, values))
    out: list[tuple[str, Plan]] = []
    seen: set = set()
    for label, hoist in ASSUMPTIONS:
        for rank, p in enumerate(k_best(graph, target, model, k, {"hoist": hoist}), 1):
            key = frozenset(frozenset(g) for g in p.groups)
            if key not in seen:
                seen.add(key)
                out.append((f"{label} #{rank}", p))
    return out
