"""The automatic plan (`fusion="auto"`): the integer program of ilp.py (the heuristic on large
graphs) under the target's static cost model, densities measured from the parameter values
when given. Plans are memoised per graph, target and values, since explain() asks again."""

from __future__ import annotations

from typing import Mapping

from ..ir.graph import Graph
from .cost import model_for
from .ilp import Plan, plan
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
