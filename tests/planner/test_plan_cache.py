"""Automatic plans kept on disk (planner/plan_cache.py): read back instead of planned, keyed by everything the
planner reads, the same key in every process."""

import dataclasses
from pathlib import Path

import pytest
import torch

from stitchflow.ir.types import TensorType
from stitchflow.planner import auto, plan_cache
from stitchflow.planner.candidates import Legality
from stitchflow.planner.stats import Densities

from planner_graphs import build

SPEC = [("matmul", 0, 1), ("relu", 2, 2), ("add", 3, 1), ("exp", 4, 4), ("matmul", 5, 1)]


@pytest.fixture
def plan_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("STITCHFLOW_CACHE", str(tmp_path))
    monkeypatch.setenv("STITCHFLOW_PLAN_CACHE", "1")
    auto._PLANS.clear()
    yield tmp_path / "plans"
    auto._PLANS.clear()


def _no_planning(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("planned again")
    monkeypatch.setattr(auto, "plan", refuse)


def test_a_plan_is_read_back_for_an_equal_graph(plan_dir, monkeypatch):
    first = auto.auto_plan(build(SPEC), "gpu")
    assert len(list(plan_dir.glob("*.pkl"))) == 1
    auto._PLANS.clear()
    _no_planning(monkeypatch)
    again = auto.auto_plan(build(SPEC), "gpu")  # an equal graph, another object: the in-memory memo misses
    assert again == first and again.regions == first.regions and again.estimates == first.estimates


def test_what_the_planner_reads_is_in_the_key():
    graph, other_target = build(SPEC), "reference"
    key = plan_cache.plan_key(graph, "gpu", Densities())
    wider = build(SPEC, n=7)  # every extent and type differs
    retyped = dataclasses.replace(graph, types=tuple(
        (name, TensorType(t.shape, torch.bfloat16, t.format) if name == "x" else t) for name, t in graph.types))
    assert key == plan_cache.plan_key(build(SPEC), "gpu", Densities())
    assert len({key, plan_cache.plan_key(wider, "gpu", Densities()),
                plan_cache.plan_key(retyped, "gpu", Densities()),
                plan_cache.plan_key(graph, other_target, Densities()),
                plan_cache.plan_key(graph, "gpu", Densities((("a", 0.01),), measured=True))}) == 5


def test_the_key_is_the_same_in_every_process(fresh_python):
    code = ("import json, sys\n"
            f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from stitchflow.planner import plan_cache\n"
            "from stitchflow.planner.stats import Densities\n"
            "from planner_graphs import build\n"
            f"print(json.dumps(plan_cache.plan_key(build({SPEC!r}), 'gpu', Densities())))\n")
    # sets inside the IR (a gather's index tensors) iterate in an order that string hashing, seeded per
    # process, decides: two fresh processes must still agree
    assert fresh_python(code, None) == fresh_python(code, None) == plan_cache.plan_key(build(SPEC), "gpu", Densities())


def test_a_file_that_does_not_load_is_planned_again_and_replaced(plan_dir, monkeypatch):
    first = auto.auto_plan(build(SPEC), "gpu")
    (path,) = plan_dir.glob("*.pkl")
    path.write_bytes(b"not a pickle")
    auto._PLANS.clear()
    assert auto.auto_plan(build(SPEC), "gpu") == first
    auto._PLANS.clear()
    _no_planning(monkeypatch)
    assert auto.auto_plan(build(SPEC), "gpu") == first


def test_off_by_environment_or_for_target_objects(plan_dir, monkeypatch):
    auto.auto_plan(build(SPEC), Legality("gpu"))  # a target object: its checks may be anything
    assert not plan_dir.exists()
    monkeypatch.setenv("STITCHFLOW_PLAN_CACHE", "0")
    auto._PLANS.clear()
    auto.auto_plan(build(SPEC), "gpu")
    assert not plan_dir.exists()


def test_an_unwritable_cache_costs_only_the_plan(plan_dir, monkeypatch):
    plan_dir.parent.mkdir(parents=True, exist_ok=True)
    plan_dir.write_text("a file where the directory should be")
    assert auto.auto_plan(build(SPEC), "gpu").regions
