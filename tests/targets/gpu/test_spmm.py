"""CSR × dense products on the gpu target under the interpreter: the kernel against a float64 product over
densities, shapes and strides (empty rows and rows longer than a chunk among them), the matcher, and GNNs."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hypothesis import given, settings, strategies as st

import stitchflow
from stitchflow.program import capture_model
from stitchflow.targets.gpu.spmm import CONFIGS, SpmmConfig, SpmmStep, sparse_product, spmm_balanced

from conftest import random_sparse

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests on CPU tensors (a GPU session runs test_spmm_cuda.py)")


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 90), features=st.integers(1, 40),
       density=st.sampled_from([0.0, 0.03, 0.3, 1.0]), transposed=st.booleans(),
       config=st.sampled_from(CONFIGS), seed=st.integers(0, 50))
def test_kernel_matches_a_float64_product(rows, cols, features, density, transposed, config, seed):
    g = torch.Generator().manual_seed(seed)
    s = random_sparse(rows, cols, density, generator=g)
    s[0] = 0.0  # an empty row
    d = torch.randn(features, cols, generator=g).t() if transposed else torch.randn(cols, features, generator=g)
    out = config(s.to_sparse_csr(), d, torch.float32)
    ref = s.double() @ d.double()
    assert out.shape == ref.shape and torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_bf16_features_accumulate_in_fp32():
    g = torch.Generator().manual_seed(0)
    s = random_sparse(30, 200, 0.5, generator=g).to_sparse_csr()  # rows far longer than a chunk
    d = torch.randn(200, 12, generator=g).to(torch.bfloat16)
    ref = s.to_dense().double() @ d.double()
    for config in CONFIGS:
        assert rel_err(config(s, d, torch.bfloat16), ref) < 1e-2


class Aggregate(torch.nn.Module):
    def forward(self, a, x):
        return torch.relu(a @ x) + 1


def test_the_matcher():
    a, x = random_sparse(20, 20, 0.2).to_sparse_csr(), torch.randn(20, 5)
    graph = capture_model(Aggregate(), (a, x)).graph
    assert sparse_product(graph, graph.nodes[0]) == ("a", "x")
    dense = capture_model(Aggregate(), (a.to_dense(), x)).graph
    assert sparse_product(dense, dense.nodes[0]) is None


@pytest.mark.parametrize("density", [0.02, 0.3])
def test_programs_run_the_kernel_and_match_eager(density):
    a, x = random_sparse(33, 33, density).to_sparse_csr(), torch.randn(33, 7)
    prog = stitchflow.compile(Aggregate(), (a, x), target="gpu", fusion="full")
    steps = [s for c in prog.compiled for s in c.steps if isinstance(s, SpmmStep)]
    assert len(steps) == 1
    assert torch.allclose(prog(a, x), Aggregate()(a, x), rtol=1e-5, atol=1e-5)
    assert "triton" in str(steps[0])


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 60), cols=st.integers(1, 70), features=st.integers(1, 20),
       density=st.sampled_from([0.0, 0.02, 0.1, 0.5, 1.0]), chunk=st.sampled_from([16, 32]),
       empty=st.lists(st.integers(0, 59), max_size=20), seed=st.integers(0, 50))
def test_balanced_chunks_across_rows(rows, cols, features, density, chunk, empty, seed):
    """Chunks that start and end inside rows, rows split over several programs, chunks inside one row,
    runs of empty rows, all against float64."""
    g = torch.Generator().manual_seed(seed)
    s = random_sparse(rows, cols, density, generator=g)
    s[[r for r in empty if r < rows]] = 0.0
    d = torch.randn(cols, features, generator=g)
    out = spmm_balanced(s.to_sparse_csr(), d, torch.float32, chunk, 2)
    ref = s.double() @ d.double()
    assert out.shape == ref.shape and torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_balanced_handles_int32_indices_and_a_row_longer_than_many_chunks():
    s = torch.zeros(6, 500)
    s[2] = torch.rand(500) + 0.5  # one row spread over 32 programs of 16
    s[4, ::7] = 1.0
    csr = s.to_sparse_csr()
    csr = torch.sparse_csr_tensor(csr.crow_indices().int(), csr.col_indices().int(), csr.values(), s.shape)
    d = torch.randn(500, 5)
    out = SpmmConfig(16, 2, balanced=True)(csr, d, torch.float32)
    assert torch.allclose(out.double(), s.double() @ d.double(), rtol=1e-5, atol=1e-5)
