"""Static cost models: recomputation exposed, intermediates free inside a region, calibration,
device profiles, and pruning of fully fused GCN on Cora."""

from __future__ import annotations

import pytest
import torch

from planner_graphs import build
from stitchflow.apps import APPS, GCN
from stitchflow.planner.cost import DataflowCostModel, Estimate, GpuCostModel, stored_bytes
from stitchflow.planner.profile import DeviceProfile
from stitchflow.planner.prune import prune
from stitchflow.planner.regions import regions_for
from stitchflow.planner.stats import Densities, measure
from stitchflow.program import capture_model


def a_xw(n=8, density=0.25):
    """t0 = x @ x (dense), t1 = a @ t0 with a CSR: fusing recomputes t0 per row of a."""
    graph = build([("matmul", 1, 1), ("matmul", 0, 2)], n)
    return graph, Densities((("a", density),))


def test_fusing_a_product_into_a_sparse_product_recomputes_it():
    graph, dens = a_xw()
    model = DataflowCostModel(dens)
    apart = model.estimate(graph, ["t0"]).flops + model.estimate(graph, ["t1"]).flops
    fused = model.estimate(graph, ["t0", "t1"])
    nest = fused.loop.nest_of("t0")
    # a[i,k] is CSR: i outside k, so t0 (over k, ...) is re-evaluated per non-zero of a's column
    assert nest.factor == pytest.approx(8 * 0.25)
    single = model.estimate(graph, ["t0"]).flops
    assert fused.recomputed_flops == pytest.approx(single * (nest.factor - 1))
    assert fused.flops == pytest.approx(apart + fused.recomputed_flops)


def test_intermediates_inside_a_region_cost_no_traffic():
    graph = build([("relu", 1, 0), ("exp", 2, 0)])
    model = DataflowCostModel()
    apart = model.estimate(graph, ["t0"]).bytes + model.estimate(graph, ["t1"]).bytes
    fused = model.estimate(graph, ["t0", "t1"]).bytes
    t0 = stored_bytes(graph, "t0", 1.0)
    assert apart - fused == pytest.approx(2 * t0)  # t0 is neither written nor read back


def test_gpu_model_has_no_storage_order_and_counts_launches():
    graph, dens = a_xw()
    model = GpuCostModel(dens)
    fused = model.estimate(graph, ["t0", "t1"])
    assert fused.recomputed_flops == 0  # any loop order: a[k]-outer traversal avoids recomputation
    feats = model.features(fused)
    assert feats[1] == pytest.approx(model.profile.launch_s)
    assert model.cost(fused) == pytest.approx(sum(feats))


def test_calibrate_recovers_scale_factors():
    graph, dens = a_xw()
    model = DataflowCostModel(dens)
    groups = [["t0"], ["t1"], ["t0", "t1"]]
    ests = [model.estimate(graph, g, {"order": o}) for g in groups for o in range(2)]
    samples = [(e, 3.0 * model.features(e)[0] + 0.5 * model.features(e)[1]) for e in ests]
    fitted = model.calibrate(samples)
    assert fitted.weights == pytest.approx((3.0, 0.5), rel=1e-6)
    gpu = GpuCostModel(dens)
    samples = [([e], 2.0 * gpu.cost(e)) for e in ests]  # a configuration is a list of regions
    assert gpu.calibrate(samples).cost(ests[0]) == pytest.approx(2.0 * gpu.cost(ests[0]), rel=1e-6)


def test_device_profile_round_trips_through_json(tmp_path):
    prof = DeviceProfile("measured", 3.0e12, 500e12, 50e12, 4e-6)
    assert DeviceProfile.load(prof.save(tmp_path / "p.json")) == prof
    assert "TB/s" in str(prof) and DeviceProfile().copy_bandwidth == 4.2e12


def test_densities_are_measured_from_tensors():
    graph, _ = a_xw(8)
    a = torch.zeros(8, 8)
    a[0, :4] = 1.0
    dens = measure(graph, {"a": a.to_sparse_csr()}, blocks=(4,))
    assert dens.storage(graph, "a") == pytest.approx(4 / 64)
    assert dens.storage(graph, "a", 4) == pytest.approx(1 / 4)  # one of four 4x4 tiles
    assert dens.storage(graph, "x") == 1.0  # dense storage: every coordinate is visited


@pytest.fixture(scope="module")
def gcn_cora():
    """GCN on Cora associated as A·(X·W): the order whose fused layers recompute X·W."""
    _, inputs = APPS["gcn"].build(size="default")
    model = GCN(association="a_xw").eval()
    captured = capture_model(model, inputs)
    values = dict(captured.param_values) | dict(zip(captured.graph.inputs, inputs))
    return captured.graph, values


def test_full_fusion_of_gcn_on_cora_is_pruned_by_recomputation(gcn_cora):
    graph, values = gcn_cora
    model = DataflowCostModel(measure(graph, values))
    configs = {f: regions_for(graph, f) for f in ("unfused", "partial", "full")}
    ests = {}
    for name, regions in configs.items():
        parts = [model.estimate(graph, r.nodes) for r in regions]
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        ests[name] = total
    result = prune(list(configs), ests)
    assert [p.config for p in result.pruned] == ["full"]
    reason = result.pruned[0].reason
    assert "unfused FLOPs" in reason and "recomputed" in reason
    ratio = ests["full"].flops / ests["unfused"].flops
    assert 8.5 <= ratio <= 18.6  # FuseFlow: full fusion does 8.5-18.6x the FLOPs of unfused


def test_auto_plan_is_no_worse_than_unfused_partial_full(gcn_cora):
    graph, values = gcn_cora
    model = DataflowCostModel(measure(graph, values))

    def cost(regions):
        return model.total([model.estimate(graph, r.nodes) for r in regions])

    auto = cost(regions_for(graph, "auto", "reference", values))
    assert all(auto <= cost(regions_for(graph, f)) * (1 + 1e-9) for f in ("unfused", "partial", "full"))


def test_estimate_sums_and_prints():
    e = Estimate(("a",), 10.0, 20.0, 0.0, 5.0)
    total = e + e
    assert total.regions == 2 and total.flops == 20.0 and "2 region(s)" in str(total)


def test_fuseflow_gcn_finding_with_its_association():
    """(A·X)·W, FuseFlow's GCN: per-layer fusion beats unfused, full fusion recomputes layer 1
    for every non-zero of A in layer 2 and is far slower (static estimate)."""
    model, inputs = APPS["gcn"].build(size="default")
    captured = capture_model(model, inputs)
    graph = captured.graph
    values = dict(captured.param_values) | dict(zip(graph.inputs, inputs))
    cost = DataflowCostModel(measure(graph, values))

    def total(fusion):
        return cost.total([cost.estimate(graph, r.nodes) for r in regions_for(graph, fusion)])

    unfused, partial, full = total("unfused"), total("partial"), total("full")
    assert partial < unfused < full
    assert full > 2 * unfused
