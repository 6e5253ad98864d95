"""CUDA-graph replay of whole gpu programs: fresh inputs on every call must give fresh, right
answers. Needs a CUDA GPU (CI has none; this runs on the lent GPU)."""

import pytest
import torch

import stitchflow
from stitchflow.apps import APPS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("app", ["bert", "llama"])
def test_replay_follows_new_inputs(app):
    model, inputs = APPS[app].build(size="small")
    model = model.cuda()
    inputs = [x.cuda() for x in inputs]
    prog = stitchflow.compile(model, inputs, target="gpu", fusion="auto", options={"cuda_graphs": "always"})
    with torch.no_grad():
        for call in range(5):
            fresh = [torch.randn_like(x) if x.is_floating_point() and x.dim() > 2 else x for x in inputs]
            torch.testing.assert_close(prog(*fresh), model(*fresh), rtol=2e-3, atol=2e-3)
    assert prog._replay.graph is not None, prog._replay.failed


@pytest.mark.parametrize("app", ["gcn", "graphsage"])
def test_gnn_replay_follows_a_new_adjacency(app):
    """A CSR adjacency is copied into the captured one (row pointers, columns, values) when its non-zero count
    matches; another count runs without the graph."""
    model, (a, x) = APPS[app].build(size="small")
    model, a, x = model.cuda(), a.cuda(), x.cuda()
    prog = stitchflow.compile(model, (a, x), target="gpu", fusion="auto", options={"cuda_graphs": "always"})
    gen = torch.Generator().manual_seed(1)

    def rewired(nnz: int) -> torch.Tensor:  # a random 0/1 adjacency with nnz entries
        flat = torch.randperm(a.shape[0] * a.shape[1], generator=gen)[:nnz]
        dense = torch.zeros(a.shape[0] * a.shape[1])
        dense[flat] = 1.0
        return dense.view(a.shape).to_sparse_csr().cuda()

    nnz = a.values().numel()
    with torch.no_grad():
        for adjacency in (a, a, a, rewired(nnz), rewired(nnz), rewired(nnz + 7), a):
            fresh = torch.randn_like(x)
            torch.testing.assert_close(prog(adjacency, fresh), model(adjacency, fresh), rtol=1e-4, atol=1e-5)
    assert prog._replay.graph is not None, prog._replay.failed
