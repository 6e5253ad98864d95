"""Scatters stored atomically by the kernel that computes their values (scatter_stores.py): message passing
(gather, message, sum or maximum into the targets) as one generated kernel, against eager over shapes, edge
counts with repeated and missing targets, and every reduction with an atomic; and the cases that stay with
torch, each with its reason. Runs under TRITON_INTERPRET=1 on CPU tensors, and on CUDA where there is one."""

import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

import stitchflow
from stitchflow.ir.index import gathered_tensors
from stitchflow.targets.gpu.grouping import TorchStep
from stitchflow.targets.gpu.runtime import GroupKernel

from conftest import assert_close, skip_unless_kernels_run

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


@pytest.fixture(autouse=True)
def _kernels_run():
    skip_unless_kernels_run()


def edges(nodes: int, count: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    src, dst = torch.randint(0, nodes, (count,), generator=g), torch.randint(0, nodes, (count,), generator=g)
    return src.to(DEVICE), dst.to(DEVICE), torch.rand(count, generator=g).to(DEVICE)


def compiled(fn, inputs, **options):
    return stitchflow.compile(fn, inputs, target="gpu", fusion="auto", options={"autotune": False, **options})


def steps(prog) -> list:
    return [s for c in prog.compiled for s in c.steps]


def scatters_through_torch(prog) -> list[str]:
    return [s.node.name for s in steps(prog) if isinstance(s, TorchStep) and s.node.is_scatter]


def why_through_torch(prog) -> str:
    return "; ".join(s.reason for s in steps(prog) if isinstance(s, TorchStep) and s.node.is_scatter)


def stored_scatters(prog) -> list[str]:
    return [sc.name for s in steps(prog) if isinstance(s, GroupKernel) for p in s.plans for _, sc in p.scatters]


@settings(max_examples=12, deadline=None)
@given(nodes=st.integers(1, 40), count=st.integers(1, 300), features=st.integers(1, 37), seed=st.integers(0, 99))
def test_gcn_messages_are_summed_by_the_kernel_that_makes_them(nodes, count, features, seed):
    src, dst, w = edges(nodes, count, seed)
    x = torch.randn(nodes, features, device=DEVICE)

    def propagate(x, src, dst, w):
        messages = torch.relu(x[src] * w[:, None]) + 1
        return torch.zeros(nodes, features, device=x.device).index_add(0, dst, messages) * 2

    prog = compiled(propagate, (x, src, dst, w))
    assert scatters_through_torch(prog) == [] and len(stored_scatters(prog)) == 1
    assert_close(prog(x, src, dst, w), propagate(x, src, dst, w))
    x2, (src2, dst2, w2) = torch.randn_like(x), edges(nodes, count, seed + 1)  # fresh inputs, same shapes
    assert_close(prog(x2, src2, dst2, w2), propagate(x2, src2, dst2, w2))


@pytest.mark.parametrize("reduce", ["sum", "amax", "amin", "mean"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_with_every_atomic(reduce, include_self):
    src, dst, w = edges(23, 150, 3)
    x = torch.randn(23, 12, device=DEVICE)
    base = torch.randn(23, 12, device=DEVICE)

    def aggregate(x, base, src, dst):
        index = dst[:, None].expand(-1, 12)
        return base.scatter_reduce(0, index, x[src] * 3, reduce, include_self=include_self)

    prog = compiled(aggregate, (x, base, src, dst))
    assert scatters_through_torch(prog) == []
    assert_close(prog(x, base, src, dst), aggregate(x, base, src, dst))


def test_a_scatter_whose_body_computes_gets_its_message_node():
    src, dst, w = edges(30, 200, 5)
    x = torch.randn(30, 9, device=DEVICE)

    def add_scaled(x, src, dst):  # index_add's alpha and the gather land in the scatter's own body
        return torch.zeros(30, 9, device=x.device).index_add(0, dst, x.index_select(0, src), alpha=0.5)

    prog = compiled(add_scaled, (x, src, dst))
    assert scatters_through_torch(prog) == [] and stored_scatters(prog)
    assert_close(prog(x, src, dst), add_scaled(x, src, dst))


def test_degrees_scatter_a_constant_with_no_feature_axis():
    src, dst, w = edges(17, 80, 7)

    def degree(w, dst):
        ones = torch.ones_like(w)
        zeros = torch.zeros(17, device=w.device)
        return zeros.index_add(0, dst, ones) + zeros.index_add(0, dst, w)

    prog = compiled(degree, (w, dst))
    assert scatters_through_torch(prog) == []
    assert_close(prog(w, dst), degree(w, dst))


def test_what_stays_with_torch_says_why():
    src, dst, w = edges(20, 100, 9)
    x = torch.randn(20, 8, device=DEVICE)

    def prod(x, src, dst):  # no atomic product
        return torch.ones(20, 8, device=x.device).index_reduce(0, dst, x[src], "prod")

    prog = compiled(prod, (x, src, dst))
    assert "no atomic prod" in why_through_torch(prog) and not stored_scatters(prog)
    assert_close(prog(x, src, dst), prod(x, src, dst))


    def double(x, src, dst):  # no float64 atomics generated
        return torch.zeros(20, 8, device=x.device, dtype=torch.float64).index_add(0, dst, x[src].double() * 2)

    prog = compiled(double, (x, src, dst))
    assert "torch.float64 are not generated" in why_through_torch(prog) and not stored_scatters(prog)
    assert_close(prog(x, src, dst), double(x, src, dst))


def test_a_message_read_elsewhere_is_stored_and_scattered_by_one_kernel():
    src, dst, w = edges(20, 100, 9)
    x = torch.randn(20, 8, device=DEVICE)

    def shared(x, src, dst):  # the messages are an output too, and two scatters read them
        m = x[src] * 2
        summed = torch.zeros(20, 8, device=x.device).index_add(0, dst, m)
        return summed, m, torch.zeros(20, 8, device=x.device).scatter_reduce(0, dst[:, None].expand(-1, 8), m, "amax")

    prog = compiled(shared, (x, src, dst))
    assert len(stored_scatters(prog)) == 2 and not scatters_through_torch(prog)
    for got, want in zip(prog(x, src, dst), shared(x, src, dst)):
        assert_close(got, want)


def test_bfloat16_messages_are_summed_in_float32_atomics():
    src, dst, w = edges(20, 100, 13)
    x = torch.randn(20, 8, device=DEVICE)

    def half(x, src, dst):  # the scatter accumulates in float32, then rounds once
        return torch.zeros(20, 8, device=x.device, dtype=torch.bfloat16).index_add(0, dst, x[src].bfloat16() * 2)

    prog = compiled(half, (x, src, dst))
    assert stored_scatters(prog) and not scatters_through_torch(prog)
    assert_close(prog(x, src, dst), half(x, src, dst))


def test_deterministic_mode_keeps_scatters_with_torch():
    src, dst, w = edges(20, 100, 11)
    x = torch.randn(20, 8, device=DEVICE)

    def propagate(x, src, dst):
        return torch.zeros(20, 8, device=x.device).index_add(0, dst, x[src] * 2)

    torch.use_deterministic_algorithms(True)
    try:
        prog = compiled(propagate, (x, src, dst))
        assert "deterministic" in why_through_torch(prog) and not stored_scatters(prog)
        assert torch.equal(prog(x, src, dst), prog(x, src, dst))
    finally:
        torch.use_deterministic_algorithms(False)
    assert stored_scatters(compiled(propagate, (x, src, dst))) and not stored_scatters(
        compiled(propagate, (x, src, dst), scatter_stores=False))


def test_positions_computed_in_the_same_kernel_stay_with_torch():
    """The kernel loads a scatter's positions from memory: positions its own kernel computes are not there yet."""
    x = torch.randn(40, 6, device=DEVICE)

    def bucket(x):
        slot = (x[:, 0].abs() * 3).long() % 7
        return torch.zeros(7, 6, device=x.device).index_add(0, slot, x * 2)

    prog = compiled(bucket, (x,))
    assert_close(prog(x), bucket(x))
    assert "positions are computed in the kernel of its message" in why_through_torch(prog)
    kernels = [s for s in steps(prog) if isinstance(s, GroupKernel)]
    for kernel in kernels:  # a kernel storing the scatter does not compute its positions
        for plan in kernel.plans:
            for _, scatter in plan.scatters:
                assert not {t for i in scatter.index for t in gathered_tensors(i)} & kernel.group_names


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("conv", ["gcn", "sage_max", "gat"])
def test_torch_geometric_layers_store_their_aggregations(conv):
    """torch_geometric's message passing through the backend on the gpu target: sums, maxima and GAT's softmax
    over incoming edges (a scatter max, then a scatter sum) are stored by the kernels of their messages."""
    pytest.importorskip("torch_geometric")
    from stitchflow import backend
    from test_backend import GraphNet

    torch.manual_seed(0)
    model = GraphNet(conv).eval().to(DEVICE)
    x, edge_index = torch.randn(40, 12, device=DEVICE), torch.randint(0, 40, (2, 150), device=DEVICE)
    compiled = torch.compile(model, backend="stitchflow", options={"target": "gpu", "autotune": False})
    with torch.no_grad():
        assert_close(compiled(x, edge_index), model(x, edge_index))
    programs = [p for m in backend.COMPILED for p in m.programs.values() if p]
    assert any(stored_scatters(p) for p in programs)
    assert not backend.FALLBACKS, backend.fallback_report()


def test_a_value_broadcast_over_the_features_is_scattered_through_its_message():
    src, dst, w = edges(25, 120, 17)
    x = torch.randn(25, 6, device=DEVICE)

    def weighted(x, w, dst):
        scale = w.exp()  # one per edge, scattered into every feature of its target
        return x + torch.zeros(25, 6, device=x.device).index_add(0, dst, scale[:, None].expand(-1, 6))

    prog = compiled(weighted, (x, w, dst))
    assert scatters_through_torch(prog) == [] and stored_scatters(prog)
    assert_close(prog(x, w, dst), weighted(x, w, dst))


def test_explain_names_the_kernel_that_stores_each_scatter_or_why_torch_runs_it():
    src, dst, w = edges(20, 100, 19)
    x = torch.randn(20, 8, device=DEVICE)

    def two(x, src, dst):
        summed = torch.zeros(20, 8, device=x.device).index_add(0, dst, x[src] * 2)
        return summed + torch.ones(20, 8, device=x.device).index_reduce(0, dst, x[src], "prod")

    report = compiled(two, (x, src, dst)).explain()
    assert "(+=) stored by the kernel of" in report
    assert "no atomic prod in Triton" in report


PINNED = [{}, {"block_p": 1, "block_l": 2}, {"block_p": 16, "block_l": 4}, {"block_p": 4, "block_l": 2, "split": 3},
          {"persistent": 3}, {"num_warps": 1}]


@pytest.mark.parametrize("pins", PINNED, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "first")
def test_every_config_stores_each_message_once(pins):
    """Atomics count every store: a config that stored a value twice (a row's split pieces each storing it) would
    double it. Edge scores (a sum over features per edge: a per-row value), their maximum per target, and the
    messages weighted by them, summed into the targets, under pinned tilings, splits and persistent grids."""
    src, dst, w = edges(19, 130, 23)
    x = torch.randn(19, 10, device=DEVICE)
    att = torch.randn(10, device=DEVICE)

    def attention(x, att, src, dst):
        score = (x[src] * att).sum(-1)  # one per edge
        top = torch.full((19,), -1e9, device=x.device).scatter_reduce(0, dst, score, "amax")
        weight = (score - top[dst]).exp()
        return torch.zeros(19, 10, device=x.device).index_add(0, dst, x[src] * weight[:, None]), top

    prog = compiled(attention, (x, att, src, dst), **pins)
    assert len(stored_scatters(prog)) == 2, why_through_torch(prog)
    for got, want in zip(prog(x, att, src, dst), attention(x, att, src, dst)):
        assert_close(got, want)


MESSAGES = {
    "gather": lambda xs, xd, w: xs,
    "weighted": lambda xs, xd, w: xs * w[:, None],
    "difference": lambda xs, xd, w: torch.tanh(xs - xd),
    "gated": lambda xs, xd, w: torch.sigmoid((xs * xd).sum(-1, keepdim=True)) * xs,
    "relu_plus": lambda xs, xd, w: torch.relu(xs + w[:, None]) + 0.5,
}
AGGREGATIONS = {
    "index_add": lambda out, dst, m: out.index_add(0, dst, m),
    "scatter_sum": lambda out, dst, m: out.scatter_add(0, dst[:, None].expand_as(m), m),
    "amax": lambda out, dst, m: out.scatter_reduce(0, dst[:, None].expand_as(m), m, "amax", include_self=False),
    "amin": lambda out, dst, m: out.scatter_reduce(0, dst[:, None].expand_as(m), m, "amin"),
    "mean": lambda out, dst, m: out.scatter_reduce(0, dst[:, None].expand_as(m), m, "mean", include_self=False),
}


@settings(max_examples=15, deadline=None)
@given(message=st.sampled_from(sorted(MESSAGES)), aggregation=st.sampled_from(sorted(AGGREGATIONS)),
       nodes=st.integers(1, 30), count=st.integers(1, 200), features=st.integers(1, 20),
       pins=st.sampled_from(PINNED), seed=st.integers(0, 99))
def test_random_message_passing_equals_eager(message, aggregation, nodes, count, features, pins, seed):
    """Messages of gathered features (weighted, differences, gates by a per-edge sum), aggregated by sum, maximum,
    minimum or mean into the targets, under pinned configs: the stored scatters against eager."""
    src, dst, w = edges(nodes, count, seed)
    x = torch.randn(nodes, features, generator=torch.Generator().manual_seed(seed)).to(DEVICE)

    def layer(x, w, src, dst):
        m = MESSAGES[message](x[src], x[dst], w)
        return AGGREGATIONS[aggregation](torch.zeros(nodes, features, device=x.device), dst, m) + x

    prog = compiled(layer, (x, w, src, dst), **pins)
    assert stored_scatters(prog), why_through_torch(prog)
    assert_close(prog(x, w, src, dst), layer(x, w, src, dst))
