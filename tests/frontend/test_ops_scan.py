"""Scans over long dims, in blocks: each element's block prefix, the blocks' totals scanned (recursively)
and combined. The block sizes are made small here so that short dims take two and three levels, on the
reference and gpu targets, against eager; one real-size scan checks the default sizes."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import stitchflow
from stitchflow.frontend import ops_scan
from conftest import assert_close, skip_unless_kernels_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SCANS = {
    "cumsum": lambda x: x.cumsum(-1),
    "cumsum_bf16": lambda x: x.bfloat16().cumsum(-1),
    "cumsum_bool": lambda x: (x > 0).cumsum(-1),
    "cumprod": lambda x: (x * 0.2 + 1).cumprod(-1),
    "cummax": lambda x: torch.cummax(x, -1),
    "cummin_ties": lambda x: torch.cummin(x.round(), -1),
    "cummax_int": lambda x: torch.cummax((x * 3).long(), -1),
    "logcumsumexp": lambda x: torch.logcumsumexp(x, -1),
}


@pytest.fixture
def small_blocks(monkeypatch):
    """Dims past 6 elements scan in blocks of 4: a dim of 7-24 takes two levels, 25 and more three."""
    monkeypatch.setattr(ops_scan, "QUADRATIC_SCAN", 6)
    monkeypatch.setattr(ops_scan, "SCAN_BLOCK", 4)


def _pairs(out, ref):
    out = out if isinstance(out, tuple) else (out,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    assert len(out) == len(ref)
    return zip(out, ref)


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("name", sorted(SCANS))
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 3), n=st.integers(5, 40), specials=st.booleans())
def test_blocked_scans_equal_eager(small_blocks, name, target, rows, n, specials):
    skip_unless_kernels_run(target)
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(n))
    if specials:  # a NaN and an infinity past the first block, a tie across blocks
        x[0, n - 2], x[-1, n - 3], x[-1, n - 1] = float("nan"), -float("inf"), x[-1, 0]
    x = x.to(DEVICE) if target == "gpu" else x
    prog = stitchflow.compile(SCANS[name], (x,), target=target)
    for out, ref in _pairs(prog(x), SCANS[name](x)):
        assert_close(out.cpu(), ref.cpu())


def test_a_scan_over_a_leading_dim_and_a_long_one(small_blocks):
    """The scanned dim in the middle; blocks of the last level read the carried totals of the dims around it."""
    x = torch.randn(2, 30, 3)
    prog = stitchflow.compile(lambda x: (x.cumsum(1), torch.cummax(x, 1).indices), (x,))
    for out, ref in _pairs(prog(x), (x.cumsum(1), torch.cummax(x, 1).indices)):
        assert_close(out, ref)


def test_a_long_cumsum_takes_the_default_blocks():
    """5000 positions (an attention mask's cumsum for position ids): blocks of SCAN_BLOCK whose 79 totals are
    scanned in one node, not n² work."""
    mask = (torch.rand(2, 5000) > 0.1).long()
    prog = stitchflow.compile(lambda m: m.cumsum(-1) - 1, (mask,))
    assert_close(prog(mask), mask.cumsum(-1) - 1)
    reduced = {n for node in prog.graph.nodes for v, n in node.dims if v in node.reduce_vars}
    assert reduced == {ops_scan.SCAN_BLOCK, -(-5000 // ops_scan.SCAN_BLOCK)}
