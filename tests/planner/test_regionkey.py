"""Structural region keys: regions equal up to names share one estimate, identical to the
uncached one (renamed loop nest included); regions that differ in what the estimate reads
(a density, an extent, a result read outside the region) get different keys."""

from __future__ import annotations

import pytest
import torch

from planner_graphs import I, J, K, read
from stitchflow.ir.expr import Call
from stitchflow.ir.graph import Graph, Node
from stitchflow.ir.types import TensorType, dense, parse_format
from stitchflow.planner.cost import DataflowCostModel, GpuCostModel, region_density
from stitchflow.planner.ilp import Costs
from stitchflow.planner.regionkey import RegionKeys
from stitchflow.planner.stats import Densities

N = 6


def product(name, sparse, operand, width=N):
    return Node(name, (I, J), Call("mul", (read(sparse, I, K), read(operand, K, J))),
                (("i", N), ("j", width), ("k", N)), reduce="sum")


def relu(name, arg):
    return Node(name, (I, J), Call("relu", (read(arg, I, J),)), (("i", N), ("j", N)))


def row_sum(name, length):
    return Node(name, (I,), read("x", I, K), (("i", N), ("k", length)), reduce="sum")


def act(name, arg, width=N):
    # exp, not relu: its values are dense like x's, so p1 streams the densities p0 does (stream
    # densities follow the whole graph and are part of the key)
    return Node(name, (I, J), Call("exp", (read(arg, I, J),)), (("i", N), ("j", width)))


def layers() -> Graph:
    """Blocks of exp(sparse @ operand): p1/r1 repeats p0/r0 on the previous block's result;
    p2 reads the other sparse input b; p3 multiplies a wider operand w; p4 is also read
    outside its block (by e4); z5/c5 repeat p0/r0 under names that sort the other way; q0 and
    q1 read a and b elementwise (dense results); m1/n1 repeat m0/n0 with relu, whose result
    streams sparse values, so m1's stream density differs from m0's while both read dense
    tensors from memory; u0 and u1 sum rows of x, u1 only its first half."""
    nodes = [product("p0", "a", "x"), act("r0", "p0"), product("p1", "a", "r0"), act("r1", "p1"),
             product("p2", "b", "r1"), act("r2", "p2"), product("p3", "a", "w", 2 * N), act("r3", "p3", 2 * N),
             product("p4", "a", "r2"), act("r4", "p4"), Node("e4", (I, J), Call("relu", (read("p4", I, J),)),
                                                              (("i", N), ("j", N))),
             product("z5", "a", "x"), act("c5", "z5"),
             Node("q0", (I, J), Call("exp", (read("a", I, J),)), (("i", N), ("j", N))),
             Node("q1", (I, J), Call("exp", (read("b", I, J),)), (("i", N), ("j", N))),
             product("m0", "a", "x"), relu("n0", "m0"), product("m1", "a", "n0"), relu("n1", "m1"),
             row_sum("u0", N), row_sum("u1", N // 2)]
    csr = TensorType((N, N), torch.float32, parse_format("csr", 2))
    types = {"a": csr, "b": csr, "x": TensorType((N, N), torch.float32, dense(2)),
             "w": TensorType((N, 2 * N), torch.float32, dense(2))}
    for node in nodes:
        shape = (N, node.extents["j"]) if "j" in node.extents else (N,)
        types[node.name] = TensorType(shape, torch.float32, dense(len(shape)))
    outputs = ("r3", "r4", "e4", "c5", "q0", "q1", "n1", "u0", "u1")
    return Graph(("a", "b", "x", "w"), (), tuple(nodes), outputs, tuple(types.items())).validate()


MODELS = [DataflowCostModel(Densities((("a", 0.25), ("b", 0.5)))), GpuCostModel(Densities((("a", 0.25), ("b", 0.5))))]
OPTIONS = [{}, {"hoist": False}, {"hoist": None}, {"block": 2}]


def keys_of(graph, model, options=None) -> RegionKeys:
    return RegionKeys(graph, region_density(graph, model.densities, (options or {}).get("block")))


@pytest.mark.parametrize("model", MODELS, ids=["dataflow", "gpu"])
@pytest.mark.parametrize("options", OPTIONS, ids=["default", "streamed", "ordered", "block2"])
def test_regions_equal_up_to_names_share_one_estimate(model, options, monkeypatch):
    graph = layers()
    keys = keys_of(graph, model, options)
    assert keys.key(("p0", "r0")) == keys.key(("p1", "r1"))
    calls = []
    original = type(model).estimate

    def counted(self, graph, nodes, options=None):
        calls.append(tuple(nodes))
        return original(self, graph, nodes, options)

    monkeypatch.setattr(type(model), "estimate", counted)
    costs = Costs(graph, model, options)
    first, second = costs.estimate(["p0", "r0"]), costs.estimate(["r1", "p1"])
    assert calls == [("p0", "r0")]  # the second region was not estimated again
    for names, cached in ((("p0", "r0"), first), (("p1", "r1"), second)):
        fresh = original(model, graph, names, options)
        assert cached == fresh and cached.loop == fresh.loop  # Estimate's == skips the loop nest
        assert costs.of(names) == model.cost(fresh)
    assert second.loop.nest_of("p1").vars and all(u.endswith(("@p1", "@r1")) for u in second.loop.order)


def test_key_tells_apart_what_the_estimate_reads():
    graph = layers()
    model = MODELS[0]
    keys = keys_of(graph, model)
    pairs = [(("p1", "r1"), ("p2", "r2")),  # b is denser than a
             (("p1", "r1"), ("p3", "r3")),  # j has another extent
             (("p1", "r1"), ("p4", "r4")),  # p4 is read outside its region: written to memory
             (("q0",), ("q1",)),  # only the density of the tensor read from memory differs
             (("m0", "n0"), ("m1", "n1")),  # only the stream density of the product differs
             (("u0",), ("u1",))]  # only the extent of the reduction differs
    for base, other in pairs:
        assert keys.key(other) != keys.key(base)
        ours, theirs = model.estimate(graph, other), model.estimate(graph, base)
        assert (ours.flops, ours.bytes) != (theirs.flops, theirs.bytes)
    # the density is keyed, not the tensor's name: b as dense as a gives p1/r1's key
    same = DataflowCostModel(Densities((("a", 0.25), ("b", 0.25))))
    same_keys = keys_of(graph, same)  # keys of one RegionKeys only compare (it numbers what it saw)
    assert same_keys.key(("p2", "r2")) == same_keys.key(("p1", "r1"))
    costs = Costs(graph, same)
    assert costs.of(["p1", "r1"]) == costs.of(["p2", "r2"]) == same.cost(same.estimate(graph, ("p2", "r2")))
    # variables are labelled var@node and legal orders break ties by those labels: node names that
    # sort the other way give another key, though this region's estimate does not depend on it
    assert keys.key(("z5", "c5")) != keys.key(("p0", "r0"))


def test_other_models_are_estimated_per_node_set():
    class Flops(DataflowCostModel):  # a subclass may estimate otherwise: no structural sharing
        def cost(self, est):
            return est.flops

    graph = layers()
    model = Flops(MODELS[0].densities)
    costs = Costs(graph, model)
    assert costs.of(["p1", "r1"]) == model.estimate(graph, ("p1", "r1")).flops
    assert costs.estimate(["p1", "r1"]).nodes == ("p1", "r1")


def chain(names: list[str]) -> Graph:
    """exp(a @ x) then exp(a @ that), under the given four node names."""
    p0, r0, p1, r1 = names
    nodes = [product(p0, "a", "x"), act(r0, p0), product(p1, "a", r0), act(r1, p1)]
    types = {"a": TensorType((N, N), torch.float32, parse_format("csr", 2)),
             "x": TensorType((N, N), torch.float32, dense(2))}
    types |= {n.name: TensorType((N, N), torch.float32, dense(2)) for n in nodes}
    return Graph(("a", "x"), (), tuple(nodes), (r1,), tuple(types.items())).validate()


@pytest.mark.parametrize("model", MODELS, ids=["dataflow", "gpu"])
def test_graphs_equal_up_to_names_share_their_estimates(model, monkeypatch):
    """A model's partitions between eager ops are often one block under other names: a graph planned after
    another estimates none of the regions they share, and its plan and estimates are those made afresh."""
    from stitchflow.planner import ilp

    first, second = chain(["p0", "r0", "p1", "r1"]), chain(["s0", "t0", "s1", "t1"])
    fresh = ilp.plan(first, "gpu", model)  # its own estimates (the fixture cleared the shared ones)
    ilp._SHAPES.clear()
    original, calls = type(model).estimate, []
    monkeypatch.setattr(type(model), "estimate", lambda self, g, nodes, options=None: calls.append(nodes) or
                        original(self, g, nodes, options))
    ilp.plan(second, "gpu", model)
    made = len(calls)
    shared = ilp.plan(first, "gpu", model)
    assert made > 0 and len(calls) == made  # the second graph's candidates were all estimated for the first
    assert shared == fresh and shared.estimates == fresh.estimates
    assert [e.loop for e in shared.estimates] == [e.loop for e in fresh.estimates]
