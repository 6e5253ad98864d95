"""The fast simulation engine agrees exactly (cycles, steps and every counter of every
primitive) with the token-stepped reference, on the apps at small size and on random
expression graphs, with unbounded and bounded channels; and the timing model's basics."""

import importlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stitchflow
from conftest import assert_close
from stitchflow.apps import APPS, GPT3Decoder
from stitchflow.targets.dataflow.simulate import Deadlock, simulate
from stitchflow.targets.dataflow.stream import parse
from stitchflow.targets.dataflow.timing import Schedule, Timing

FUSIONS = ["unfused", "partial", "full"]


def both(prog, inputs, **timing):
    """Simulate with both engines; equal results, or both deadlock. Returns the fast one."""
    try:
        fast = simulate(prog, prog._bind(inputs), **timing)
    except Deadlock:
        with pytest.raises(Deadlock):
            simulate(prog, prog._bind(inputs), engine="reference", **timing)
        return None
    ref = simulate(prog, prog._bind(inputs), engine="reference", **timing)
    assert fast.cycles == ref.cycles
    for rf, rr in zip(fast.regions, ref.regions, strict=True):
        assert rf.cycles == rr.cycles
        assert rf.prims == rr.prims  # steps, finish time and counters of every primitive
    assert fast.counters == ref.counters
    return fast


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("app", ["gcn", "graphsage", "sae"])
def test_apps_small_engines_agree(app, fusion):
    model, inputs = APPS[app].build(size="small")
    prog = stitchflow.compile(model, inputs, target="dataflow", fusion=fusion)
    res = both(prog, inputs)
    assert res.cycles > 0 and res.flops > 0
    assert_close(res.outputs, model(*inputs))


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("app", ["gcn", "graphsage", "sae"])
def test_stepped_engine_equals_closed_forms(app, fusion):
    """The compiled stepping (bounded channels' engine) against the closed-form recurrences,
    unbounded, on graphs larger than the Python reference takes (Cora-sized GCN is 50x this)."""
    model, inputs = APPS[app].build(size="small")
    prog = stitchflow.compile(model, inputs, target="dataflow", fusion=fusion)
    fast = simulate(prog, prog._bind(inputs))
    stepped = simulate(prog, prog._bind(inputs), engine="stepped")
    assert [r.prims for r in fast.regions] == [r.prims for r in stepped.regions]
    assert fast.cycles == stepped.cycles and fast.counters == stepped.counters
    with pytest.raises(ValueError, match="unknown simulation engine"):
        simulate(prog, prog._bind(inputs), engine="magic")


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("app", ["gcn", "sae"])
def test_apps_small_bounded_channels(app, fusion):
    model, inputs = APPS[app].build(size="small")
    prog = stitchflow.compile(model, inputs, target="dataflow", fusion=fusion)
    free = simulate(prog, prog._bind(inputs))
    res = both(prog, inputs, channel_depth=64)
    assert res is None or res.cycles >= free.cycles  # backpressure only delays


@pytest.mark.parametrize("fusion", FUSIONS)
def test_gpt3_bigbird_decoder_engines_agree(fusion):
    # APPS["gpt3-bigbird"] small is 1e8 tokens: too many for a Python reference
    torch.manual_seed(0)
    model = GPT3Decoder(width=8, heads=2, ffn=8, seq=64, block=16).eval()
    x = torch.randn(64, 8)
    prog = stitchflow.compile(model, (x,), target="dataflow", fusion=fusion)
    assert both(prog, (x,), memory_model=fusion == "unfused").cycles > 0


@pytest.mark.parametrize("par", [{"i": 2}, {"i": 3}, {"i": 2, "j": 2}])
def test_parallel_lanes_engines_agree(par):
    a = _sparse((9, 7), 0.4, 1)
    b = _dense((7, 5), 2)
    fn = lambda x, y: torch.softmax(x @ y, dim=-1)  # noqa: E731
    prog = stitchflow.compile(fn, (a, b), target="dataflow", fusion="full", formats={0: "dcsr"}, options={"par": par})
    res = both(prog, (a, b))
    assert_close(res.outputs, fn(a, b))
    one = both(stitchflow.compile(fn, (a, b), target="dataflow", fusion="full", formats={0: "dcsr"}), (a, b))
    assert res.cycles < one.cycles


def test_shallow_channels_deadlock_in_both_engines():
    a = torch.rand(6, 7)
    prog = stitchflow.compile(lambda x: torch.softmax(x, dim=-1), (a,), target="dataflow", fusion="full")
    assert both(prog, (a,), channel_depth=1) is None  # the row is needed twice: max, then exp


def test_memory_model_costs_cycles_and_counts_traffic():
    a = torch.where(torch.rand(16, 16) < 0.3, torch.rand(16, 16), torch.zeros(()))
    b = torch.rand(16, 8)
    # i k j: each row of x scanned once (orders that rescan it per j estimate about as fast)
    prog = stitchflow.compile(lambda x, y: x @ y, (a, b), target="dataflow", fusion="full", formats={0: "csr"},
                              options={"order": "i k j"})
    plain = both(prog, (a, b))
    mem = both(prog, (a, b), memory_model=True)
    assert mem.cycles > plain.cycles
    nnz = int((a != 0).sum())
    c = plain.counters
    assert c.crd_read == nnz  # one coordinate per stored entry of the compressed level
    assert c.val_written == 16 * 8
    assert c.bytes == 4 * (c.crd_read + c.seg_read + c.crd_written + c.val_read + c.val_written)


def test_recurrence_closed_form():
    from stitchflow.targets.dataflow.region_run import emitted, fire, ready
    import numpy as np

    sched = Schedule(4, (None,), (None,), 2, 3)
    t_in = np.array([0, 1, 10, 11])
    t = fire(sched, ready(sched, [t_in]))
    assert t.tolist() == [0, 2, 10, 12]  # max(input, previous + interval)
    assert emitted(sched, t, 0).tolist() == [3, 5, 13, 15]


def test_block_latencies():
    torch.manual_seed(0)
    a, b = torch.rand(32, 32), torch.rand(32, 32)
    fn = lambda x, y: x @ y  # noqa: E731
    scalar = stitchflow.compile(fn, (a, b), target="dataflow", fusion="full")
    tiles = stitchflow.compile(fn, (a, b), target="dataflow", fusion="full", options={"block": 16})
    rs, rt = both(scalar, (a, b)), both(tiles, (a, b))
    assert rs.flops == rt.flops == 2 * 32 ** 3 or rt.flops >= 32 ** 3
    assert rt.cycles < rs.cycles  # 2x2x2 tile steps instead of 32^3 scalar ones


def test_timing_table_overrides():
    tm = Timing.make(ii={"join": 2}, latency={"alu": 5}, channel_depth=4)
    assert tm.ii_of("join") == 2 and tm.ii_of("scan") == 1 and tm.lat_of("alu") == 5 and tm.lat_of("load") == 0
    with pytest.raises(ValueError):
        Timing.make(channel_depth=0)
    assert str(parse("0 2 S0 D")) == "0 2 S0 D"


# ---------------------------------------------------------------- random expression graphs

def _sparse(shape, density, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=g) < density
    return torch.where(mask, torch.rand(shape, generator=g) + 0.5, torch.zeros(()))


def _dense(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


EXPRS = {
    "spmm": (lambda a, b, c: a @ b, lambda m, k, n: [(m, k), (k, n), (m, n)]),
    "sddmm": (lambda a, b, c: c * (a @ b), lambda m, k, n: [(m, k), (k, n), (m, n)]),
    "chain": (lambda a, b, c: torch.relu(a @ b) @ c, lambda m, k, n: [(m, k), (k, n), (n, m)]),
    "add_mul": (lambda a, b, c: (a + c) * c - a, lambda m, k, n: [(m, n), (k, n), (m, n)]),
    "rowsum": (lambda a, b, c: (a * c).sum(dim=1) + a.amax(dim=1), lambda m, k, n: [(m, n), (k, n), (m, n)]),
    "softmax": (lambda a, b, c: torch.softmax(a @ b, dim=-1), lambda m, k, n: [(m, k), (k, n), (m, n)]),
    "colsum": (lambda a, b, c: (a @ b).sum(dim=0) * 2.0, lambda m, k, n: [(m, k), (k, n), (m, n)]),
}
FORMATS = ["dense", "csr", "dcsr", "csc", "dcsc"]


@settings(max_examples=210, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expr=st.sampled_from(sorted(EXPRS)), m=st.integers(1, 6), k=st.integers(1, 6), n=st.integers(1, 6),
       d=st.sampled_from([0.0, 0.2, 0.5, 1.0]), fa=st.sampled_from(FORMATS), fc=st.sampled_from(FORMATS),
       fusion=st.sampled_from(["unfused", "full"]), depth=st.sampled_from([None, None, 1, 2, 3, 8]),
       mem=st.booleans(), seed=st.integers(0, 1000))
def test_random_expressions_engines_agree(expr, m, k, n, d, fa, fc, fusion, depth, mem, seed):
    fn, shapes = EXPRS[expr]
    sa, sb, sc = shapes(m, k, n)
    inputs = (_sparse(sa, d, seed), _dense(sb, seed + 1), _sparse(sc, 0.6, seed + 2))
    prog = stitchflow.compile(fn, inputs, target="dataflow", fusion=fusion, formats={0: fa, 2: fc})
    res = both(prog, inputs, channel_depth=depth, memory_model=mem)
    if res is not None:
        assert_close(res.outputs, fn(*inputs))


def test_cli_reports_a_deadlock_as_an_error(capsys):
    from stitchflow.cli import main

    assert main(["simulate", "gcn", "--dataset", "tiny", "--fusion", "partial", "--channel-depth", "8", "--json"]) == 2
    assert "channels of depth 8 deadlock" in capsys.readouterr().err


def test_cli_names_an_app_the_simulator_does_not_know():
    from stitchflow.cli import main

    with pytest.raises(SystemExit, match="unknown app 'hf-bert' for the dataflow simulator; known: bert"):
        main(["simulate", "hf-bert"])


def test_cli_simulates_with_the_token_estimated_orders(capsys):
    import json

    from stitchflow.cli import main

    cycles = {}
    for by in ("cycles", "tokens"):
        assert main(["simulate", "gpt3-bigbird", "--size", "small", "--block", "16", "--fusion", "partial",
                     "--order-by", by, "--json"]) == 0
        cycles[by] = json.loads(capsys.readouterr().out)["cycles"]
    assert cycles["cycles"] < cycles["tokens"]


def test_a_simulation_drops_each_regions_result_after_its_last_reader(monkeypatch):
    """Between regions, env holds only what a later region reads or the program returns (a 736,389 x
    349 class layer kept three dead float32 tensors, 3 GB, while its last regions ran)."""
    sim_module = importlib.import_module("stitchflow.targets.dataflow.simulate")
    real = sim_module.run_region
    model, inputs = APPS["graphsage"].build(size="small")
    prog = stitchflow.compile(model, inputs, target="dataflow", fusion="unfused")
    made = {o.name for c in prog._compiled for o in c.dataflow.outputs}
    held = []  # the regions' results in env as each region starts

    def run_region(df, env, *args):
        held.append(set(env) & made)
        return real(df, env, *args)

    monkeypatch.setattr(sim_module, "run_region", run_region)
    env = prog._bind(inputs)
    res = simulate(prog, env)
    graph = prog.graph
    assert len(held) == len(prog._compiled) > 4
    for k, names in enumerate(held):
        later = {t for c in prog._compiled[k:] for n in c.region.nodes for t in graph.node_of[n].inputs}
        assert names <= later | set(graph.outputs)
    assert set(env) & made == set(graph.outputs)
    assert_close(res.outputs, model(*inputs))
