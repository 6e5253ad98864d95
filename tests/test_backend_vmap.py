"""torch.vmap bodies rewritten on whole tensors (backend_vmap): each compiled function equals eager on fresh inputs,
with nothing left eager; bodies the rewrite cannot take still run eagerly, with the reason."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from hypothesis import given, settings
from hypothesis import strategies as st

import stitchflow.backend as backend
import stitchflow.training as training
from conftest import assert_close

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _scan_combine(a, b):
    """transformers' Mamba scan, generic combine: vmapped over the pairs of a level of the scan."""
    def combine(a_left, b_left, a_right, b_right):
        return a_left * a_right, a_right * b_left + b_right

    return torch.vmap(combine, in_dims=2, out_dims=2)(a[..., ::2, :], b[..., ::2, :], a[..., 1::2, :], b[..., 1::2, :])


BODIES = {
    "elementwise, an unbatched operand": (
        lambda x, w: torch.vmap(lambda r: (r * w + 1).sigmoid())(x), [(4, 3, 5), (3, 5)]),
    "an unbatched operand of higher rank": (
        lambda x, w: torch.vmap(lambda r: torch.where(r > 0, r, w))(x), [(4, 5), (3, 5)]),
    "two batched operands of different ranks": (
        lambda x, y: torch.vmap(lambda r, s: r * s.exp(), in_dims=(0, 1))(x, y), [(4, 3, 5), (5, 4)]),
    "in_dims None and out_dims": (
        lambda x, w: torch.vmap(lambda r, v: (r - v).relu(), in_dims=(1, None), out_dims=1)(x, w), [(3, 4, 5), (5,)]),
    "reductions along dims": (
        lambda x: torch.vmap(lambda r: r - r.mean(-1, keepdim=True) + r.amax(0))(x), [(4, 3, 5)]),
    "softmax, cumsum and a full sum": (
        lambda x: torch.vmap(lambda r: r.softmax(-1).cumsum(0) * r.sum())(x), [(4, 3, 5)]),
    "an empty dim list reduces every logical dim": (
        lambda x: torch.vmap(lambda r: r - torch.sum(r, dim=[]))(x), [(4, 3, 5)]),
    "a full reduction of a logical scalar": (
        lambda x: torch.vmap(lambda r: torch.sum(r * 2) + 1)(x), [(7,)]),
    "functional and method forms, a cast": (
        lambda x: torch.vmap(lambda r: torch.nn.functional.gelu(r).float().clamp(-1, 1).pow(2))(x), [(4, 6)]),
    "Mamba's scan combine": (_scan_combine, [(2, 6, 8, 4), (2, 6, 8, 4)]),
    "matrix products, a shared weight": (
        lambda x, y, w: torch.vmap(lambda a, b: (a @ w).relu() @ b, in_dims=(0, 2))(x, y),
        [(3, 5, 4), (6, 2, 3), (4, 6)]),
    "an ensemble's layers, stacked weights and biases": (
        lambda x, w, b: torch.vmap(lambda w, b: F.gelu(F.linear(x, w, b)).sum(-1), in_dims=(0, 0))(w, b),
        [(2, 5, 4), (3, 6, 4), (3, 6)]),
    "batched inputs and a stacked bias": (
        lambda x, w, b: torch.vmap(lambda x, b: F.linear(x, w, b), in_dims=(1, 0))(x, b), [(5, 3, 4), (6, 4), (3, 6)]),
    "nested vmaps, pairwise distances": (
        lambda x, y: torch.vmap(torch.vmap(lambda a, b: (a - b).square().sum(-1), in_dims=(None, 0)),
                                in_dims=(0, None))(x, y), [(3, 4), (5, 4)]),
    "nested vmaps over one tensor, out_dims": (
        lambda x, w: torch.vmap(torch.vmap(lambda v: (v * w).softmax(-1), out_dims=1), in_dims=2, out_dims=0)(x),
        [(3, 5, 4, 6), (6,)]),
    "an inner vmap over an outer one's result": (
        lambda x, y: torch.vmap(lambda r, s: torch.vmap(lambda a: a * s.sum())(r.exp()) + r, in_dims=(1, 0))(x, y),
        [(4, 3, 5), (3, 2)]),
    "scans, arg-reductions and variances along dims": (
        lambda x: torch.vmap(lambda r: (r.cumprod(-1) + r.logcumsumexp(0)) * r.argmax(-1, keepdim=True)
                             + r.var(0, keepdim=True) + r.std() + r.argsort(-1) + r.logsumexp(-1, keepdim=True))(x),
        [(4, 3, 5)]),
    "a layer norm over trailing dims, unbatched weights": (
        lambda x, w: torch.vmap(lambda r: F.layer_norm(r, (5,), w, w * 0.5) + F.rms_norm(r, (3, 5)))(x),
        [(4, 3, 5), (5,)]),
    "ops with several results: sort, topk, running maxima, var_mean": (
        lambda x: torch.vmap(lambda r: r.sort(-1, descending=True).values * torch.topk(r, 2, dim=0)[1].sum(0)
                             + torch.cummax(r, 1).indices + torch.var_mean(r, 1, keepdim=True)[1]
                             + torch.max(r, 0).values + torch.kthvalue(r, 2, -1, True).values)(x),
        [(4, 3, 2)]),
    "views: indexing, reshapes, transposes, squeezes, expands": (
        lambda x: torch.vmap(lambda r: r[1:, None, ::2].squeeze(1).transpose(0, 1).reshape(-1).view(2, 2).unsqueeze(0)
                             .expand(3, 2, 2).permute(2, 0, 1).flatten(1, 2).narrow(1, 1, 3).select(0, 1)
                             + r[..., 0].sum() + r[0].t().flatten().sum())(x),
        [(4, 3, 4)]),
    "a matrix product of batched stacks of different ranks": (
        lambda x, y: torch.vmap(lambda a, b: torch.matmul(a, b).softmax(-1))(x, y), [(3, 5, 4), (3, 2, 4, 6)]),
}


@pytest.mark.parametrize("name", BODIES)
def test_a_vmap_body_runs_on_whole_tensors(name):
    fn, shapes = BODIES[name]
    args = [torch.randn(s) for s in shapes]
    got, want = torch.compile(fn, backend="stitchflow")(*args), fn(*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert_close(g, w)
    assert backend.FALLBACKS == []
    assert backend.regions_executed() >= 1


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 5), rows=st.integers(1, 4), cols=st.integers(1, 6), in_dim=st.integers(0, 2),
       out_dim=st.integers(0, 2), reduce_dim=st.sampled_from([0, 1, -1]))
def test_vmapped_bodies_of_any_layout_equal_eager(batch, rows, cols, in_dim, out_dim, reduce_dim):
    torch._dynamo.reset()
    backend.FALLBACKS.clear()
    x = torch.randn([rows, cols][:in_dim] + [batch] + [rows, cols][in_dim:])
    w = torch.randn(cols)

    def fn(x, w):
        body = lambda r: (r * w).tanh() + r.sum(reduce_dim, keepdim=True)  # noqa: E731
        return torch.vmap(body, in_dims=in_dim, out_dims=out_dim)(x)

    assert_close(torch.compile(fn, backend="stitchflow", dynamic=False)(x, w), fn(x, w))
    assert backend.FALLBACKS == []


def test_an_ensemble_of_modules_through_functional_call():
    """torch.func's ensembling recipe: the models' parameters stacked, one functional_call vmapped over them."""
    from torch.func import functional_call, stack_module_state

    models = [nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)) for _ in range(5)]
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")

    def ensemble(params, buffers, x):
        return torch.vmap(lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None))(params, buffers, x)

    x = torch.randn(32, 8)
    with torch.no_grad():
        assert_close(torch.compile(ensemble, backend="stitchflow")(params, buffers, x), ensemble(params, buffers, x))
    assert backend.FALLBACKS == []


REFUSED = {
    "a matmul": (lambda x: torch.vmap(lambda r: r @ r)(x[0]), "matmul"),
    "indexing a batched value by a tensor": (lambda x: torch.vmap(lambda r: r[torch.tensor([0, 2])] * 2)(x),
                                             "by tensors"),
    "a var_mean of every dim": (lambda x: torch.vmap(lambda r: r - torch.var_mean(r)[1])(x), "no dim"),
    "a layer norm with a batched weight": (lambda x: torch.vmap(lambda r, w: F.layer_norm(r, (5,), w))(x, x[:, 0]),
                                           "batched weight"),
    "an argmax over every dim": (lambda x: torch.vmap(lambda r: r * r.argmax())(x), "no dim"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_body_the_rewrite_cannot_take_compiles_through_aotautograd(name):
    """AOTAutograd traces the vmap into batched ATen ops, which compile like any other."""
    fn, _ = REFUSED[name]
    x = torch.randn(3, 4, 5)
    assert_close(torch.compile(fn, backend="stitchflow")(x), fn(x))
    assert backend.FALLBACKS == [], backend.fallback_report()


@pytest.mark.parametrize("name", REFUSED)
def test_where_aotautograd_cannot_trace_it_the_body_runs_eagerly_with_the_reason(name, monkeypatch):
    monkeypatch.setattr(training, "_through_aot", lambda *args, **kwargs: None)
    fn, why = REFUSED[name]
    x = torch.randn(3, 4, 5)
    assert_close(torch.compile(fn, backend="stitchflow")(x), fn(x))
    report = backend.fallback_report()
    assert "not rewritten on whole tensors" in report and why in report
