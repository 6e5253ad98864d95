"""Regions run in chunks of their outermost loop (chunked.py) give the whole run's outputs bit
for bit and its counters exactly, and its cycles within a few cycles a chunk; regions that
cannot be chunked say why and run whole."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stitchflow
from conftest import assert_close
from stitchflow.apps import APPS
from stitchflow.targets.dataflow import dataflows
from stitchflow.targets.dataflow.chunked import Chunking, run_in_chunks, why_not_chunked
from stitchflow.targets.dataflow.target import CompiledRegion

CASES = [("gcn", "unfused", {}), ("gcn", "partial", {}), ("gcn", "full", {"hoist": False}),
         ("graphsage", "partial", {}), ("graphsage", "full", {"hoist": False}),
         ("sae", "full", {}), ("gpt3-bigbird", "partial", {"block": 16})]
CYCLES_PER_CHUNK = 4  # the closing tokens' slack (measured: at most 2 a chunk on these)


def whole_and_chunked(prog, inputs, budget=2000):
    whole = prog.simulate(*inputs, chunk_tokens=None)
    chunked = prog.simulate(*inputs, chunk_tokens=budget)
    return whole, chunked


def assert_chunked_matches(whole, chunked):
    assert torch.equal(whole.outputs, chunked.outputs)
    assert whole.counters == chunked.counters
    for w, c in zip(whole.regions, chunked.regions, strict=True):
        assert w.counters == c.counters
        assert abs(c.cycles - w.cycles) <= CYCLES_PER_CHUNK * c.chunks


@pytest.mark.parametrize("app,fusion,options", CASES)
def test_chunked_regions_give_the_whole_runs_outputs_counters_and_cycles(app, fusion, options):
    model, inputs = APPS[app].build(size="small")
    prog = stitchflow.compile(model, inputs, target="dataflow", fusion=fusion, options=options)
    whole, chunked = whole_and_chunked(prog, inputs)
    assert max(r.chunks for r in chunked.regions) > 1
    assert_chunked_matches(whole, chunked)
    with torch.no_grad():
        assert_close(chunked.outputs, model(*inputs))


def test_a_region_under_the_budget_runs_whole_exactly():
    model, inputs = APPS["gcn"].build(size="small")
    prog = stitchflow.compile(model, inputs, target="dataflow", fusion="partial")
    whole = prog.simulate(*inputs, chunk_tokens=None)
    default = prog.simulate(*inputs)
    assert [r.chunks for r in default.regions] == [1] * len(default.regions)
    assert [r.prims for r in default.regions] == [r.prims for r in whole.regions]


def test_reductions_over_the_outer_loop_are_not_chunked_and_say_why():
    model, inputs = APPS["sae"].build(size="small")
    prog = stitchflow.compile(model, inputs, target="dataflow", fusion="unfused")
    reasons = [why_not_chunked(df) for df in dataflows(prog)]
    assert any(isinstance(r, str) and "reduces over the outer variable k" in r for r in reasons)
    whole, chunked = whole_and_chunked(prog, inputs)
    assert_chunked_matches(whole, chunked)
    for r, res in zip(reasons, chunked.regions):
        assert res.chunks == 1 or isinstance(r, Chunking)


def test_a_buffer_read_again_in_the_region_is_not_chunked():
    model, inputs = APPS["gcn"].build(size="small")
    prog = stitchflow.compile(model, inputs, target="dataflow", fusion="full")  # hoisted layer 1
    (df,) = dataflows(prog)
    why = why_not_chunked(df)
    assert isinstance(why, str) and ("reduces over the outer variable" in why or "buffer" in why)
    whole, chunked = whole_and_chunked(prog, inputs)
    assert chunked.regions[0].chunks == 1 and whole.cycles == chunked.cycles


def test_a_programs_call_runs_large_regions_in_chunks():
    model, inputs = APPS["gcn"].build(size="small")
    prog = stitchflow.compile(model, inputs, target="dataflow", fusion="partial")
    expected = prog(*inputs)
    env = prog._bind(inputs)
    chunks = []
    for c in prog._compiled:
        if isinstance(c, CompiledRegion):
            stats = {}
            done = run_in_chunks(c.dataflow, env, None, 2000, stats=stats)
            chunks.append(done[1])
            assert sum(stats.values()) == c.tokens  # the whole run's tokens, from the call above
        else:
            c(env)
    assert min(chunks) > 1
    assert torch.equal(prog.outputs_of(env), expected)


def _graph(n, density, seed):
    g = torch.Generator().manual_seed(seed)
    a = (torch.rand(n, n, generator=g) < density).float() * (torch.rand(n, n, generator=g) + 0.5)
    return a + torch.eye(n)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(5, 40), density=st.sampled_from([0.0, 0.02, 0.1, 0.5]), width=st.integers(1, 6),
       fusion=st.sampled_from(["unfused", "partial", "full"]), budget=st.sampled_from([50, 400, 3000]),
       seed=st.integers(0, 2**16))
def test_chunked_equals_whole_on_random_graphs(n, density, width, fusion, budget, seed):
    a = _graph(n, density, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x, w = torch.randn(n, width, generator=g), torch.randn(width, 3, generator=g)

    def layer(a, x, w):
        return torch.relu(a @ (x @ w)) * 2.0

    ins = (a.to_sparse_csr(), x, w)
    prog = stitchflow.compile(layer, ins, target="dataflow", fusion=fusion, options={"hoist": False})
    whole, chunked = whole_and_chunked(prog, ins, budget)
    assert_chunked_matches(whole, chunked)
    assert_close(chunked.outputs, layer(a, x, w))
