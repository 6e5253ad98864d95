"""explain: every producer -> consumer pair gets a verdict and a reason; unfused pairs say
what decided (legality, shape, or the cost comparison)."""

from __future__ import annotations

import pytest

import stitchflow
from planner_graphs import TwoContractions, build
from stitchflow.apps import APPS, GCN
from stitchflow.planner.explain import explain_regions, pair_verdicts
from stitchflow.planner.regions import ordered_regions, regions_for
from stitchflow.program import capture_model


@pytest.fixture(scope="module")
def gcn():
    """A·(X·W) association: fusing X·W into A·(X·W) recomputes it per row of A."""
    _, inputs = APPS["gcn"].build(size="small")
    model = GCN(in_features=inputs[1].shape[1], out_features=8, association="a_xw").eval()
    captured = capture_model(model, inputs)
    return captured.graph, dict(captured.param_values) | dict(zip(captured.graph.inputs, inputs))


@pytest.mark.parametrize("fusion", ["unfused", "partial", "full", "auto"])
def test_every_pair_has_a_reason(gcn, fusion):
    graph, values = gcn
    regions = regions_for(graph, fusion, "reference", values)
    verdicts = pair_verdicts(graph, regions, fusion, "reference", values)
    edges = {(p, n.name) for n in graph.nodes for p in graph.producers(n)}
    assert {(v.producer, v.consumer) for v in verdicts} == edges
    for v in verdicts:
        assert v.reason.strip()
        if v.fused:
            assert "saves" in v.reason and "recomputed FLOPs" in v.reason
        else:
            assert any(word in v.reason for word in ("recompute", "fused ", "would save", "refuses", "cycle", "convex"))


def test_auto_fuses_the_first_product_when_it_can_be_hoisted(gcn):
    graph, values = gcn
    regions = regions_for(graph, "auto", "reference", values)
    verdicts = {(v.producer, v.consumer): v for v in pair_verdicts(graph, regions, "auto", "reference", values)}
    first = verdicts[("matmul", "matmul_1")]  # X·W1 -> A·(X·W1): hoisted into a buffer, not recomputed
    assert first.fused and "0 recomputed FLOPs" in first.reason


def test_legality_reasons_reach_the_report():
    graph = build([("matmul", 1, 0), ("matmul", 2, 0), ("matmul", 3, 0), ("relu", 4, 0)])
    regions = ordered_regions(graph, [["t0", "t1"], ["t2", "t3"]])
    text = explain_regions(graph, regions, [["t0", "t1"], ["t2", "t3"]], TwoContractions())
    assert "t1 -> t2: not fused" in text and "refuses the fused region: 3 contractions" in text


def test_program_explain_lists_every_pair():
    model, inputs = APPS["gcn"].build(size="small")
    report = stitchflow.compile(model, inputs, fusion="unfused").explain()
    pairs = [line for line in report.splitlines() if " -> " in line and ": " in line]
    assert pairs and all("not fused" in line and line.rsplit(": ", 1)[1].strip() for line in pairs
                         if "parts of one torch op" not in line)
