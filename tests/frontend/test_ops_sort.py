"""Sorting (topk, sort, argsort, msort, kthvalue, median) on the reference and gpu targets, along short dims
and along long ones (merge-ranked; small blocks here, so that short rows take that path too):
values equal eager's; indices point at those values (eager leaves the order of ties unspecified, so
they are checked by gathering, and equal eager's where a row has no ties). NaN sorts as the largest
value, infinities and ties included."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import stitchflow
from stitchflow import backend
from stitchflow.frontend import ops_sort
from conftest import assert_close, skip_unless_kernels_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# each returns (values, indices, dim of the indices) or (values,)
CASES = {
    "topk": lambda x: (*torch.topk(x, min(3, x.shape[-1])), -1),
    "topk_smallest_dim0": lambda x: (*torch.topk(x, 2, dim=0, largest=False), 0),
    "sort_descending": lambda x: (*torch.sort(x, dim=1, descending=True), 1),
    "sort": lambda x: (*torch.sort(x, stable=True), -1),
    "argsort": lambda x: (torch.sort(x, dim=0).values, x.argsort(dim=0), 0),
    "msort": lambda x: (torch.msort(x),),
    "kthvalue": lambda x: (*torch.kthvalue(x, 2, dim=1, keepdim=True), 1),
    "median": lambda x: (*torch.median(x, dim=-1), -1),
    "median_all": lambda x: (torch.median(x),),
}


def _check(out, ref, x):
    assert_close(out[0], ref[0])
    if len(ref) == 1:
        return
    indices, dim = out[1], ref[2]
    values = ref[0]
    picked = torch.take_along_dim(x, indices if indices.dim() == x.dim() else indices.unsqueeze(dim), dim)
    assert_close(picked.reshape(values.shape), values)


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=3, deadline=None)
@given(rows=st.integers(2, 6), cols=st.integers(3, 9), dtype=st.sampled_from(["float32", "bfloat16", "int64"]),
       specials=st.booleans())
def test_sorts_equal_eager(name, target, rows, cols, dtype, specials):
    skip_unless_kernels_run(target)
    g = torch.Generator().manual_seed(rows * 16 + cols)
    x = torch.randn(rows, cols, generator=g)
    if specials:  # NaN, infinities and ties
        x[0, 1], x[-1, 0], x[1, -1] = float("nan"), float("inf"), -float("inf")
        x[:, 2] = x[:, 0]
    x = (x.nan_to_num(0.0, 7.0, -7.0) * 3).long() if dtype == "int64" else x.to(getattr(torch, dtype))
    if target == "gpu":
        x = x.to(DEVICE)
    fn = lambda x: CASES[name](x)[:2]  # noqa: E731
    prog = stitchflow.compile(fn, (x,), target=target, fusion="full")
    # against eager on the CPU: torch 2.11's CUDA median of a whole bfloat16 tensor skips a NaN that its
    # documentation (and the CPU) returns
    _check(tuple(t.cpu() for t in prog(x)), CASES[name](x.cpu()), x.cpu())


@pytest.fixture
def small_blocks(monkeypatch):
    """Rows past 8 elements are merge-ranked in blocks of 4 (3-8 blocks at the shapes below)."""
    monkeypatch.setattr(ops_sort, "QUADRATIC_SORT", 8)
    monkeypatch.setattr(ops_sort, "SORT_BLOCK", 4)


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cols=st.integers(9, 30), dtype=st.sampled_from(["float32", "bfloat16", "int64"]), specials=st.booleans())
def test_merge_ranked_sorts_equal_eager(small_blocks, name, target, cols, dtype, specials):
    test_sorts_equal_eager.hypothesis.inner_test(name, target, 3, cols, dtype, specials)


def test_a_sort_too_long_to_merge_is_refused_with_the_reason(monkeypatch):
    """The binary searches hold a position per element and block: past MAX_SEARCHED the sort runs eagerly."""
    monkeypatch.setattr(ops_sort, "MAX_SEARCHED", 1000)
    with pytest.raises(stitchflow.StitchflowError, match="topk.*would search 18000 element and block pairs"):
        stitchflow.compile(lambda x: torch.topk(x, 3), (torch.randn(2, 3000),))


def test_a_long_row_sorts_with_the_default_blocks():
    """A mixture-of-experts router's expert ids over 1500 tokens, two each (3000 > QUADRATIC_SORT): argsort
    stable, as transformers groups the tokens by expert; ties are most of the row."""
    experts = torch.randint(0, 8, (1500, 2), generator=torch.Generator().manual_seed(0))
    prog = stitchflow.compile(lambda e: torch.argsort(e.flatten(), stable=True), (experts,))
    assert torch.equal(prog(experts), torch.argsort(experts.flatten(), stable=True))
    x = torch.randn(2, 2500)
    prog = stitchflow.compile(lambda x: torch.topk(x, 5), (x,))
    _check(prog(x), (*torch.topk(x, 5), -1), x)


def test_a_mixture_of_experts_router_compiles_whole():
    """softmax over the experts, the top two, renormalised: one program, no fallback."""
    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(16, 8)

        def forward(self, h):
            weights, experts = torch.topk(torch.softmax(self.gate(h), -1), 2)
            return weights / weights.sum(-1, keepdim=True), experts

    router, h = Router(), torch.randn(10, 16)
    backend.reset()
    torch._dynamo.reset()
    weights, experts = torch.compile(router, backend="stitchflow")(h)
    ref_weights, ref_experts = router(h)
    assert_close(weights, ref_weights)
    assert torch.equal(experts, ref_experts)
    assert backend.FALLBACKS == [], backend.fallback_report()


BOUNDARIES = torch.tensor([-1.0, 0.0, 0.0, 0.5, 2.0])
SEARCHES = {
    "searchsorted_left": lambda s, v, order: torch.searchsorted(s, v),
    "searchsorted_right_int32": lambda s, v, order: torch.searchsorted(s, v, side="right", out_int32=True),
    "searchsorted_one_row": lambda s, v, order: torch.searchsorted(s[0], v, right=True),
    "searchsorted_scalar": lambda s, v, order: torch.searchsorted(s[1], 0.3),
    "searchsorted_sorter": lambda s, v, order: torch.searchsorted(s.gather(-1, order.argsort(-1)), v, sorter=order),
    "searchsorted_integers": lambda s, v, order: torch.searchsorted((s.clamp(-5, 5) * 4).long(), (v * 4).long()),
    "bucketize": lambda s, v, order: torch.bucketize(v, BOUNDARIES),
    "bucketize_right": lambda s, v, order: torch.bucketize(v, BOUNDARIES, right=True, out_int32=True),
}


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("blocks", ["counted", "searched"])
@pytest.mark.parametrize("name", sorted(SEARCHES))
def test_insertion_points_equal_eager(name, blocks, target, monkeypatch):
    """A row of up to QUADRATIC_SORT is counted in one reduction; a longer one binary-searched (made short here)."""
    skip_unless_kernels_run(target)
    if blocks == "searched":
        monkeypatch.setattr(ops_sort, "QUADRATIC_SORT", 4)
    g = torch.Generator().manual_seed(len(name))
    seq = torch.randn(3, 11, generator=g).sort(-1).values
    seq[0, 3], seq[1, -1] = seq[0, 4], float("inf")  # a tie, an infinity
    values = torch.randn(3, 6, generator=g)
    values[0, 0], values[1, 1], values[2, 2] = seq[0, 4], float("nan"), -float("inf")  # on a tie, NaN, -inf
    order = torch.randperm(11, generator=g).repeat(3, 1)
    if name == "searchsorted_integers":
        values = values.nan_to_num(0.0, 3.0, -3.0)
    inputs = tuple(t.to(DEVICE) for t in (seq, values, order)) if target == "gpu" else (seq, values, order)
    prog = stitchflow.compile(SEARCHES[name], inputs, target=target)
    out, ref = prog(*inputs).cpu(), SEARCHES[name](seq, values, order)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
