"""Differential tests: every supported op, captured and interpreted, equals eager PyTorch on
random shapes (hypothesis) and random data."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import stitchflow
from conftest import assert_close

dims = st.integers(1, 6)


def check(fn, *inputs, fusion="unfused"):
    prog = stitchflow.compile(fn, inputs, fusion=fusion)
    expected = fn(*inputs)
    actual = prog(*inputs)
    if isinstance(expected, torch.Tensor):
        assert actual.shape == expected.shape
        assert_close(actual, expected)
    else:
        for a, e in zip(actual, expected):
            assert_close(a, e)
    assert prog.regions_executed == len(prog.regions)
    return prog


UNARY = {
    "relu": torch.relu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
    "exp": torch.exp, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "neg": lambda x: -x,
    "rsqrt": lambda x: torch.rsqrt(x.abs() + 0.5), "sqrt": lambda x: (x * x).sqrt(), "abs": torch.abs,
    "log": lambda x: torch.log(x.abs() + 1), "erf": torch.erf, "clamp": lambda x: x.clamp(-0.5, 0.5),
    "scalar_ops": lambda x: (2.0 * x + 1) / 3 - x ** 2, "rsub": lambda x: 1 - x,
    "dropout_eval": lambda x: F.dropout(x, 0.3, training=False), "cast": lambda x: x.double().float(),
    "softplus": lambda x: F.softplus(x * 8, 2.0, 5.0), "hardtanh": lambda x: F.hardtanh(x, -0.5, 0.75),
    "relu6": lambda x: F.relu6(x * 8), "hardsigmoid": lambda x: F.hardsigmoid(x * 4),
    "hardswish": lambda x: F.hardswish(x * 4), "elu": lambda x: F.elu(x, 0.5), "mish": F.mish,
    "leaky_relu": lambda x: F.leaky_relu(x, negative_slope=0.2),
    "sin_cos": lambda x: x.sin() * torch.cos(x * 3), "rounding": lambda x: (x * 4).round() + torch.floor(x * 3) - x.ceil(),
    "log1p_expm1": lambda x: torch.log1p(x.abs() * 1e-3) + torch.expm1(x * 1e-4),
}


@pytest.mark.parametrize("name", sorted(UNARY))
@settings(max_examples=8, deadline=None)
@given(shape=st.lists(dims, min_size=1, max_size=3))
def test_unary(name, shape):
    check(UNARY[name], torch.randn(shape))


BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": lambda a, b: a / (b.abs() + 1),
    "max": torch.maximum, "min": torch.minimum, "where": lambda a, b: torch.where(a > b, a, b),
    "masked_fill": lambda a, b: a.masked_fill(b > 0, float("-inf")).exp(), "alpha": lambda a, b: torch.add(a, b, alpha=2),
}


@pytest.mark.parametrize("name", sorted(BINARY))
@settings(max_examples=8, deadline=None)
@given(shape=st.lists(dims, min_size=2, max_size=3), bcast=st.integers(0, 2))
def test_binary_with_broadcasting(name, shape, bcast):
    other = list(shape)
    if bcast == 1:
        other[-1] = 1
    elif bcast == 2:
        other = other[1:]
    check(BINARY[name], torch.randn(shape), torch.randn(other))


REDUCTIONS = {
    "sum": lambda x: x.sum(-1), "sum_keep": lambda x: x.sum(dim=0, keepdim=True), "mean": lambda x: x.mean(),
    "amax": lambda x: x.amax(-1), "softmax": lambda x: torch.softmax(x, -1), "softmax0": lambda x: F.softmax(x, dim=0),
    "log_softmax": lambda x: F.log_softmax(x, -1), "max_all": lambda x: torch.max(x),
    "layer_norm": lambda x: F.layer_norm(x, x.shape[-1:]),
    "rms_norm": lambda x: F.rms_norm(x, x.shape[-1:], eps=1e-6),
    "manual_rms": lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
    "amin": lambda x: x.amin(-1), "amin_all": torch.amin, "var_biased": lambda x: x.var(-1, unbiased=False),
    "std_all": lambda x: torch.std(x, correction=0), "var_keep": lambda x: x.var((0, -1), keepdim=True, correction=0),
    "norm": lambda x: x.norm(), "norm_dim": lambda x: torch.norm(x, dim=-1, keepdim=True),
    "norm_1": lambda x: x.norm(p=1, dim=0), "vector_norm_inf": lambda x: torch.linalg.vector_norm(x, ord=math.inf, dim=-1),
    "stack": lambda x: torch.stack([x, x.relu() * 2], 1), "stack_last": lambda x: torch.stack([x, -x], -1).sum(-1),
    "max_dim": lambda x: x.max(-1), "min_dim_keep": lambda x: torch.min(x, 0, keepdim=True),
    "max_values": lambda x: x.max(dim=0).values * 2, "argmax": lambda x: x.argmax(-1) + 1,
    "argmin_keep": lambda x: torch.argmin(x, 0, keepdim=True), "min_all": lambda x: x.min(),
    "glu": lambda x: F.glu(torch.cat([x, x * 2], -1), -1), "global_pool": lambda x: F.adaptive_avg_pool1d(x, 1),
}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@settings(max_examples=8, deadline=None)
@given(shape=st.lists(dims, min_size=2, max_size=3))
def test_reductions(name, shape):
    check(REDUCTIONS[name], torch.randn(shape))


@settings(max_examples=10, deadline=None)
@given(shape=st.lists(st.integers(2, 6), min_size=1, max_size=3), keepdim=st.booleans(), dtype=st.sampled_from(
    [torch.float32, torch.bfloat16]))
def test_var_and_std_in_torchs_spellings(shape, keepdim, dtype):
    x = (torch.randn(shape) * 3 + 10).to(dtype)  # a mean far from zero: the centred pass matters
    for fn in (lambda x: torch.var(x), lambda x: x.std(0, True, keepdim), lambda x: x.var(dim=-1, keepdim=keepdim),
               lambda x: torch.std(x, -1, correction=2) if x.shape[-1] > 2 else x.std(-1),
               lambda x: x.var(unbiased=False)):
        prog = stitchflow.compile(fn, (x,))
        assert_close(prog(x), fn(x))


def test_max_and_argmax_take_the_first_of_ties():
    x = torch.tensor([[1.0, 5.0, 5.0, 0.0], [2.0, 2.0, -1.0, 2.0]]).to(torch.bfloat16)
    for fn in (lambda x: x.max(-1), lambda x: x.argmin(-1), lambda x: torch.max(x, 0)):
        prog = stitchflow.compile(fn, (x,))
        for o, r in zip(prog(x), fn(x)) if not isinstance(fn(x), torch.Tensor) else [(prog(x), fn(x))]:
            assert torch.equal(o, r)


@settings(max_examples=10, deadline=None)
@given(shape=st.lists(dims, min_size=1, max_size=3), dim=st.integers(0, 2), seed=st.integers(0, 100))
def test_gather_along_a_dim(shape, dim, seed):
    g = torch.Generator().manual_seed(seed)
    dim = dim % len(shape)
    x = torch.randn(shape, generator=g)
    index_shape = [max(1, n - 1) if d != dim else 3 for d, n in enumerate(shape)]
    index = torch.randint(0, shape[dim], index_shape, generator=g)
    check(lambda x, i: torch.gather(x, dim, i) * 2, x, index)


def test_embedding_gathers_rows():
    weight, index = torch.randn(20, 6), torch.randint(0, 20, (3, 5))
    check(lambda i, w: F.embedding(i, w, padding_idx=0) * 2, index, weight)
    before = weight.clone()
    with pytest.raises(stitchflow.StitchflowError, match="max_norm"):
        stitchflow.compile(lambda i, w: F.embedding(i, w, max_norm=1.0), (index, weight))
    assert torch.equal(weight, before)  # refused before capture ran it


def test_var_over_no_more_elements_than_the_correction_is_refused():
    with pytest.raises(stitchflow.StitchflowError, match="correction"):
        stitchflow.compile(lambda x: x.var(-1), (torch.randn(3, 1),))


def test_layer_norm_with_affine():
    w, b = torch.randn(7), torch.randn(7)
    check(lambda x: F.layer_norm(x, (7,), w, b, 1e-5), torch.randn(3, 5, 7))


@pytest.mark.parametrize("shape", [(6, 5), (4, 5, 7), (3, 5, 4, 6)])
def test_batch_norm_with_running_or_batch_statistics(shape):
    c = shape[1]
    rm, rv, w, b = torch.randn(c), torch.rand(c) + 0.5, torch.randn(c), torch.randn(c)
    check(lambda x: F.batch_norm(x, rm, rv, w, b, training=False), torch.randn(shape))
    check(lambda x: F.batch_norm(x, rm, rv, training=False, eps=1e-3), torch.randn(shape))
    check(lambda x: F.batch_norm(x, None, None, w, b, training=True), torch.randn(shape), fusion="full")
    check(lambda x: torch.relu(F.batch_norm(x, None, None, training=True) + 1), torch.randn(shape), fusion="full")


def test_batch_norm_updating_its_running_statistics_is_refused_before_it_runs():
    rm, rv = torch.zeros(5), torch.ones(5)
    with pytest.raises(stitchflow.StitchflowError, match="running statistics in place"):
        stitchflow.compile(lambda x: F.batch_norm(x, rm, rv, training=True), [torch.randn(4, 5, 3)])
    assert rm.abs().max() == 0 and bool((rv == 1).all())  # capture never ran it


@pytest.mark.parametrize("shape,groups", [((2, 6, 4, 5), 3), ((3, 8, 7), 8), ((2, 4), 2), ((2, 6, 3, 2, 2), 1)])
def test_group_norm(shape, groups):
    w, b = torch.randn(shape[1]), torch.randn(shape[1])
    check(lambda x: F.group_norm(x, groups, w, b, 1e-4), torch.randn(shape) * 2 + 3, fusion="full")
    check(lambda x: torch.relu(F.group_norm(x, groups)), torch.randn(shape))


def test_instance_norm_with_input_or_running_statistics():
    w, b, rm, rv = torch.randn(5), torch.randn(5), torch.randn(5), torch.rand(5) + 0.5
    check(lambda x: F.instance_norm(x, weight=w, bias=b), torch.randn(3, 5, 4, 6), fusion="full")
    check(lambda x: F.instance_norm(x, rm, rv, w, b, use_input_stats=False), torch.randn(3, 5, 4, 6))
    with pytest.raises(stitchflow.StitchflowError, match="running statistics in place"):
        stitchflow.compile(lambda x: F.instance_norm(x, rm, rv), [torch.randn(3, 5, 4)])


def test_an_output_reshaping_a_computed_tensor_is_a_view_not_a_copy():
    prog = check(lambda x: (x * 2 + 1).reshape(x.shape[0], -1), torch.randn(3, 4, 5))
    assert not [n for n in prog.graph.nodes if n.origin == "output"]  # no copy node for the reshape
    out = prog(torch.randn(3, 4, 5))
    assert out.shape == (3, 20) and out._base is not None


VIEWS = {
    "transpose": lambda x: x.transpose(0, -1) * 2, "permute": lambda x: x.permute(2, 0, 1) + 1,
    "reshape_merge": lambda x: x.reshape(x.shape[0], -1) + 1, "flatten": lambda x: torch.flatten(x) * 1,
    "view_split": lambda x: x.view(-1).view(x.shape[2], -1) + 0, "unsqueeze": lambda x: x.unsqueeze(1) * x.unsqueeze(0),
    "expand": lambda x: x[:, :1].expand(-1, 4, -1) + 0, "slice": lambda x: x[1:, ::2, -1] + 0,
    "t_matmul": lambda x: x[0].t() @ x[0], "chunk": lambda x: torch.chunk(x, 2, dim=-1)[0] * 3,
    "cat": lambda x: torch.cat([x, -x[..., :1]], dim=-1), "repeat": lambda x: x.repeat(2, 1, 1) + 0,
    "heads": lambda x: x.reshape(x.shape[0], x.shape[1], -1).transpose(0, 1).reshape(x.shape[1], -1) * 1,
    "rotate_half": lambda x: torch.cat([-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]], dim=-1),
}


@pytest.mark.parametrize("name", sorted(VIEWS))
@settings(max_examples=8, deadline=None)
@given(a=st.integers(2, 5), b=st.integers(2, 5), c=st.integers(2, 6))
def test_views_become_index_arithmetic(name, a, b, c):
    check(VIEWS[name], torch.randn(a, b, c))


@settings(max_examples=10, deadline=None)
@given(b=st.integers(1, 3), m=dims, k=dims, n=dims)
def test_contractions(b, m, k, n):
    x, y, w = torch.randn(b, m, k), torch.randn(b, k, n), torch.randn(n, k)
    check(torch.matmul, x, y)
    check(torch.bmm, x, y)
    check(lambda p: F.linear(p, w, torch.ones(n)), x)
    check(lambda p, q: torch.einsum("bmk,bkn->bmn", p, q), x, y)
    check(lambda p: p[0] @ w.t() @ w, x)
    check(lambda p: p[0, 0] @ w.t(), x)  # vector @ matrix


def test_index_select_and_scatter_add():
    x = torch.randn(10, 4)
    idx = torch.tensor([3, 1, 1, 9, 0])

    def gather_scatter(x, idx):
        msg = x.index_select(0, idx) * 2
        return torch.zeros(10, 4).index_add(0, idx, msg), x[idx] + 1

    check(gather_scatter, x, idx)


def test_sparse_matmul_inputs():
    from conftest import random_sparse

    a = random_sparse(30, 20, 0.1)
    x = torch.randn(20, 5)
    for layout in (a.to_sparse_csr(), a.to_sparse(), a.to_sparse_csc(), a):
        check(lambda s, d: torch.relu(s @ d), layout, x)
        check(lambda s, d: torch.sparse.mm(s, d) + 1, layout, x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes(dtype):
    x = torch.randn(4, 9, dtype=dtype)
    w = torch.randn(9, dtype=dtype)
    prog = stitchflow.compile(lambda a: F.gelu(F.layer_norm(a, (9,), w)) @ a.t(), (x,))
    expected = F.gelu(F.layer_norm(x, (9,), w)) @ x.t()
    assert_close(prog(x), expected, dtype)
    assert math.isfinite(float(prog(x).float().sum()))


@settings(max_examples=25, deadline=None)
@given(density=st.sampled_from([0.01, 0.05, 0.2, 0.5, 1.0]), m=st.integers(1, 40), k=st.integers(1, 40),
       n=st.integers(1, 8), layout=st.sampled_from(["csr", "coo", "csc", "dense"]), seed=st.integers(0, 99))
def test_sparse_products_at_several_densities(density, m, k, n, layout, seed):
    from conftest import random_sparse

    g = torch.Generator().manual_seed(seed)
    a = random_sparse(m, k, density, generator=g)
    a = {"csr": a.to_sparse_csr, "coo": a.to_sparse, "csc": a.to_sparse_csc, "dense": lambda: a}[layout]()
    x, w = torch.randn(k, n, generator=g), torch.randn(n, n, generator=g)
    check(lambda s, d: torch.softmax(torch.relu(s @ (d @ w)) + 1, -1), a, x, fusion="full")


@settings(max_examples=15, deadline=None)
@given(shape=st.lists(dims, min_size=1, max_size=3), dim=st.integers(0, 2),
       kind=st.sampled_from(["float32", "bfloat16", "bool", "int32", "to_float64"]))
def test_cumsum_in_every_dtype(shape, dim, kind):
    x = torch.randn(shape)
    dim = dim % len(shape)
    fn = {"float32": lambda x: x.cumsum(dim) * 2, "bfloat16": lambda x: x.bfloat16().cumsum(dim),
          "bool": lambda x: (x > 0).cumsum(dim), "int32": lambda x: (x * 4).int().cumsum(dim) - 1,
          "to_float64": lambda x: torch.cumsum(x, dim, dtype=torch.float64)}[kind]
    prog = check(fn, x)
    assert prog.graph.nodes[-1].dims  # lowered, not eager


