"""Scatters (frontend/ops_scatter.py): reductions into computed positions (scatter_add, index_add, scatter_reduce
and index_reduce with every reduce, with and without the base) and overwrites (scatter with a source, index_put,
index_copy, index_fill, x[idx] = v, masked_scatter), on the reference and gpu targets, equal to eager on random shapes in float32
and bfloat16, with indices from all distinct to mostly duplicates. Where several points write one position the
last one wins, as in eager's CPU kernels and its deterministic mode. Through the backend: a static KV cache's
index_copy_, a graph's max aggregation, a graph attention layer's softmax over edges and a router's unsort compile
with no fallback."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import stitchflow
from stitchflow.ir.index import Gather
from stitchflow import backend
from conftest import assert_close, assert_close_to_truth, skip_unless_kernels_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REDUCES = ("sum", "prod", "mean", "amax", "amin")


def _reduce_cases():
    """x: (n, f) base, src: (m, f) values, rows: (m,) positions in [0, n)."""
    cases = {}
    for reduce in REDUCES:
        for include_self in (True, False):
            def fn(x, src, rows, reduce=reduce, include_self=include_self):
                at = rows[:, None].expand(-1, x.shape[1])
                return x.scatter_reduce(0, at, src, reduce, include_self=include_self)

            cases[f"scatter_reduce_{reduce}{'' if include_self else '_alone'}"] = fn
    for reduce in ("prod", "mean", "amax", "amin"):
        cases[f"index_reduce_{reduce}"] = lambda x, src, rows, reduce=reduce: x.index_reduce(0, rows, src, reduce)
    cases["index_add_alpha"] = lambda x, src, rows: x.index_add(0, rows, src, alpha=-1.5)
    cases["scatter_add_columns"] = lambda x, src, rows: x.scatter_add(
        1, (src[: x.shape[0]].abs() * 7).long() % x.shape[1], src[: x.shape[0]])
    return cases


OVERWRITES = {
    "scatter_src": lambda x, src, rows: x.scatter(0, rows[:, None].expand(-1, x.shape[1]), src * 2),
    # (scatter's index may be smaller than the output in every dim: src[:n] keeps its rows within x's)
    "scatter_part_of_the_rows": lambda x, src, rows: x.scatter(1, (src[: x.shape[0], :2].abs() * 5).long() % x.shape[1],
                                                               src[: x.shape[0]]),
    "scatter_number": lambda x, src, rows: x.scatter(1, (src[: x.shape[0]].abs() * 5).long() % x.shape[1], -3.0),
    "index_put": lambda x, src, rows: torch.index_put(x, (rows,), src - 1),
    "index_put_number": lambda x, src, rows: torch.index_put(x, (rows,), torch.tensor(0.25, dtype=x.dtype)),
    "index_put_columns": lambda x, src, rows: torch.ops.aten.index_put(x, [None, rows % x.shape[1]],
                                                                      x[:, :1] * src[:, 0]),
    "index_copy": lambda x, src, rows: x.index_copy(0, rows, src),
    "index_fill": lambda x, src, rows: x.index_fill(1, rows % x.shape[1], 5.0),
    # a boolean mask over the leading dims with one value for every selected row or element
    "masked_rows_vector": lambda x, src, rows: torch.index_put(x, (x[:, 0] > 0,), src[0] * 2),
    "masked_elements_added": lambda x, src, rows: torch.index_put(x, (x > 0,), torch.tensor([1.5], dtype=x.dtype),
                                                                  accumulate=True),
    "masked_setitem": lambda x, src, rows: _set_rows_where_positive(x, src),
}


def _set_rows_where_positive(x, src):
    y = x * 1
    y[x[:, 0] > 0] = src[0]
    return y

REDUCTIONS = _reduce_cases()


def _inputs(n, m, f, distinct, half, seed):
    """rows draw from `distinct` positions of n: 1.0 is a permutation's worth, lower means more duplicates."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if half else torch.float32
    x, src = torch.randn(n, f, generator=g).to(dtype), torch.randn(m, f, generator=g).to(dtype)
    choices = torch.randperm(n, generator=g)[: max(1, math.ceil(distinct * n))]
    rows = choices[torch.randint(len(choices), (m,), generator=g)]
    return x, src, rows


def _compiled(fn, args, target):
    """The compiled fn's result on `args` (moved to the GPU for the gpu target where there is one), on the CPU."""
    skip_unless_kernels_run(target)
    if target == "gpu":
        args = tuple(a.to(DEVICE) for a in args)
    return stitchflow.compile(fn, args, target=target)(*args).cpu()


SHAPES = given(n=st.integers(1, 9), m=st.integers(1, 12), f=st.integers(1, 5),
               distinct=st.sampled_from([1.0, 0.5, 0.1]), half=st.booleans())


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@settings(max_examples=4, deadline=None)
@SHAPES
def test_reductions_into_positions_equal_eager(name, target, n, m, f, distinct, half):
    x, src, rows = _inputs(n, m, f, distinct, half, seed=n * 1000 + m * 10 + f)
    fn = REDUCTIONS[name]
    if "prod" in name:  # values near 1, so that products of many stay in range
        src = (src * 0.1 + 1).to(src.dtype)
    assert_close_to_truth(_compiled(fn, (x, src, rows), target), fn, (x, src, rows))


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("name", sorted(OVERWRITES))
@settings(max_examples=4, deadline=None)
@SHAPES
def test_overwrites_equal_eager_the_last_write_winning(name, target, n, m, f, distinct, half):
    """Against eager on the CPU, whose kernels write in order (CUDA's leave the choice among duplicates open)."""
    x, src, rows = _inputs(n, m, f, distinct, half, seed=n * 1000 + m * 10 + f)
    if name == "index_copy":  # one source row per index
        src = src[: len(rows)]
    fn = OVERWRITES[name]
    got, want = _compiled(fn, (x, src, rows), target), fn(x, src, rows)
    assert torch.equal(got, want), (got, want)


def _merged_image_features(embeddings, ids, features):
    """A vision-language model's merge: image features written over the image tokens' embeddings, in order."""
    tokens = (ids == 3).unsqueeze(-1).expand_as(embeddings)
    return embeddings.masked_scatter(tokens, features) * 2


@pytest.mark.parametrize("target", ["reference", "gpu"])
@settings(max_examples=6, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(1, 12), width=st.integers(1, 6), density=st.sampled_from([0.0, 0.3, 1.0]))
def test_masked_scatter_writes_the_source_in_order(target, batch, length, width, density):
    """Fresh masks at each call (the count of earlier selected rows is computed, not traced), a mask expanded over
    the hidden dim and an elementwise one."""
    g = torch.Generator().manual_seed(batch * 100 + length * 10 + width)
    embeddings = torch.randn(batch, length, width, generator=g)
    features = torch.randn(batch * length * width + 2, generator=g)
    prog = None
    for _ in range(2):
        ids = torch.where(torch.rand(batch, length, generator=g) < density, 3, 5)
        args = (embeddings, ids, features)
        if prog is None:
            skip_unless_kernels_run(target)
            prog = stitchflow.compile(_merged_image_features, args, target=target)
        assert torch.equal(prog(*args), _merged_image_features(*args))
    by_element = lambda x, s: x.masked_scatter(x > 0.5, s[: x.numel()] * 3)  # noqa: E731
    assert torch.equal(stitchflow.compile(by_element, (embeddings, features), target=target)(embeddings, features),
                       by_element(embeddings, features))


def test_the_last_write_wins_as_in_deterministic_mode():
    x, v = torch.zeros(6), torch.arange(1.0, 9.0)
    rows = torch.tensor([3, 1, 3, 3, 0, 1, 5, 3])
    fn = lambda x, v: torch.index_put(x, (rows,), v)  # noqa: E731
    prog = stitchflow.compile(fn, (x, v))
    torch.use_deterministic_algorithms(True)
    try:
        want = fn(x, v)
    finally:
        torch.use_deterministic_algorithms(False)
    assert prog(x, v).tolist() == want.tolist() == [5.0, 6.0, 0.0, 8.0, 0.0, 7.0]


def test_maxima_keep_nan_and_integer_means_round_down():
    x = torch.tensor([1.0, 2.0, 3.0, math.nan])
    rows, src = torch.tensor([0, 0, 1, 3]), torch.tensor([math.nan, 1.0, 5.0, 0.0])
    amax = lambda x, s: x.scatter_reduce(0, rows, s, "amax")  # noqa: E731
    assert_close(stitchflow.compile(amax, (x, src))(x, src), amax(x, src))
    ints, values = torch.tensor([5, 7, -3, 2]), torch.tensor([2, 3, -4, -5])
    mean = lambda x, s: x.scatter_reduce(0, rows, s, "mean")  # noqa: E731
    assert stitchflow.compile(mean, (ints, values))(ints, values).tolist() == mean(ints, values).tolist() == [3, 1, -3, -2]


def test_the_graph_names_each_scatters_reduction():
    x, src, rows = torch.randn(4, 3), torch.randn(5, 3), torch.tensor([0, 2, 2, 1, 0])
    prog = stitchflow.compile(lambda x, s: x.index_reduce(0, rows, s, "amin", include_self=False), (x, src))
    text = str(prog.graph)
    assert " min= " in text and " += " in text  # the minima, and the count that tells where nothing was written


def test_the_dataflow_target_refuses_a_scatter_with_the_reason():
    x, src, rows = torch.randn(4, 3), torch.randn(5, 3), torch.tensor([0, 2, 2, 1, 0])
    with pytest.raises(stitchflow.StitchflowError, match="scatters into its output"):
        stitchflow.compile(lambda x, s: x.index_copy(0, rows[:4], s[:4]), (x, src), target="dataflow")


def test_refusals_name_the_problem():
    flags, rows = torch.tensor([True, False, True]), torch.tensor([0, 0, 2])
    with pytest.raises(stitchflow.StitchflowError, match="over booleans"):
        stitchflow.compile(lambda f: f.scatter_reduce(0, rows, f, "amax"), (flags,))
    x = torch.tensor([[1.0, 2.0], [-1.0, 0.5], [3.0, -2.0]])  # two rows selected: two rows of values
    with pytest.raises(stitchflow.StitchflowError, match="one entry per selected element"):
        stitchflow.compile(lambda x: torch.index_put(x, (x[:, 0] > 0,), torch.ones(2, 2)), (x,))


# ---------------------------------------------------------------- through the backend

def _static_cache_update(cache, keys, positions):
    """A static KV cache (transformers' StaticCache): the new keys copied in at their positions."""
    cache = cache * 1
    cache.index_copy_(2, positions, keys)
    return (cache.softmax(-1) * 2).sum(-2)


def _max_aggregation(x, src, dst):
    """A graph layer's max aggregation (torch_geometric's aggr="max"): each node the largest of its messages."""
    messages = (x[src] * 2).relu()
    out = x.new_zeros(x.shape).scatter_reduce(0, dst[:, None].expand(-1, x.shape[1]), messages, "amax",
                                              include_self=False)
    return out + x


def _attention_over_edges(x, w, att, src, dst):
    """A graph attention layer (GAT) as torch_geometric writes it: each edge's score, a softmax over the edges
    into each node (the maximum scattered, gathered back, exponentials summed by a scatter) and the weighted
    messages summed into their targets."""
    h = x @ w
    score = torch.nn.functional.leaky_relu((h[src] * att[0]).sum(-1) + (h[dst] * att[1]).sum(-1), 0.2)
    top = score.new_full((x.shape[0],), -torch.inf).scatter_reduce(0, dst, score, "amax", include_self=False)
    weight = (score - top[dst]).exp()
    total = weight.new_zeros(x.shape[0]).index_add(0, dst, weight)
    alpha = weight / (total[dst] + 1e-16)
    return torch.zeros_like(h).index_add(0, dst, h[src] * alpha[:, None]).relu()


def _unsort(scores):
    """A router's unsort: the inverse permutation of a sort, written as inv[perm] = arange(n)."""
    perm = scores.argsort()
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    return scores[perm][inverse] * 2 + inverse


BACKEND_CASES = {
    "static_cache": (_static_cache_update, lambda g: (torch.randn(2, 3, 8, 4, generator=g),
                                                      torch.randn(2, 3, 2, 4, generator=g), torch.tensor([5, 2]))),
    "max_aggregation": (_max_aggregation, lambda g: (torch.randn(10, 4, generator=g),
                                                     torch.randint(0, 10, (30,), generator=g),
                                                     torch.randint(0, 10, (30,), generator=g))),
    "unsort": (_unsort, lambda g: (torch.randn(40, generator=g),)),
    "image_features": (_merged_image_features, lambda g: (torch.randn(2, 9, 8, generator=g),
                                                          torch.tensor([[5, 3, 3, 5, 5, 5, 3, 5, 5]] * 2),
                                                          torch.randn(6, 8, generator=g))),
    "graph_attention": (_attention_over_edges, lambda g: (torch.randn(12, 6, generator=g), torch.randn(6, 8, generator=g),
                                                          torch.randn(2, 8, generator=g),
                                                          torch.randint(0, 12, (40,), generator=g),
                                                          torch.randint(0, 12, (40,), generator=g))),
}


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("name", sorted(BACKEND_CASES))
def test_scatters_compile_through_the_backend_without_fallbacks(name):
    fn, make = BACKEND_CASES[name]
    args = make(torch.Generator().manual_seed(0))
    compiled = torch.compile(fn, backend="stitchflow")
    assert_close(compiled(*args), fn(*args))
    assert not backend.FALLBACKS, backend.fallback_report()


def test_a_scatter_whose_positions_are_literals_runs_where_its_values_are():
    """Into a one-row tensor every write lands on row 0: the position is a literal, which the interpreter evaluates
    on the CPU; the scatter must still run on its values' device (CUDA on the GPU target; meta stands in here)."""
    from stitchflow.ir.interpret import eval_node

    x, v, rows = torch.randn(1, 3), torch.randn(2, 3), torch.tensor([0, 0])
    prog = stitchflow.compile(lambda x, v: torch.index_put(x, (rows,), v), (x, v))
    graph = prog.graph
    env = {name: torch.empty(graph.type_of[name].shape, dtype=graph.type_of[name].dtype, device="meta")
           for name in (*graph.inputs, *graph.params)}
    scatters = [n for n in graph.nodes if n.is_scatter]
    assert scatters and all(not any(isinstance(i, Gather) for i in n.index) for n in scatters)
    for node in graph.nodes:
        env[node.name] = eval_node(node, env, graph.type_of[node.name])
        assert env[node.name].device.type == "meta"


def _merged_loss(embeddings, ids, features):
    return (_merged_image_features(embeddings, ids, features).tanh() * torch.linspace(-1, 1, embeddings.shape[-1])).sum()


def _elementwise_loss(x, source):
    return x.masked_scatter(x > 0.3, source * 3).sin().sum()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("case", ["rows", "rows_flat_source", "elements"])
def test_masked_scatter_trains_through_the_backend(case, target):
    """The source's gradient (aten.masked_scatter_backward: the selected elements of the output's gradient in
    order, zeros after) compiles with the rest of the backward graph."""
    skip_unless_kernels_run(target)
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[5, 3, 3, 5, 3], [3, 5, 5, 5, 5]])
    fn, args = {
        "rows": (_merged_loss, (torch.randn(2, 5, 4, generator=g), ids, torch.randn(6, 4, generator=g))),
        "rows_flat_source": (_merged_loss, (torch.randn(2, 5, 4, generator=g), ids, torch.randn(30, generator=g))),
        "elements": (_elementwise_loss, (torch.randn(4, 6, generator=g), torch.randn(30, generator=g))),
    }[case]
    leaves = [a.requires_grad_() for a in args if a.is_floating_point()]
    want = torch.autograd.grad(fn(*args), leaves)
    got = torch.autograd.grad(torch.compile(fn, backend="stitchflow", options={"target": target})(*args), leaves)
    for a, b in zip(got, want):
        assert_close(a, b)
    assert not backend.FALLBACKS, backend.fallback_report()
