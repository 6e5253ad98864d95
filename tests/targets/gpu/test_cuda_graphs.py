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


class NormedHead(torch.nn.Module):
    """A final norm and a wide head, as a language model ends: the head's output is 32 MiB in float32."""

    def __init__(self, width=64, vocab=131072):
        super().__init__()
        self.norm, self.head = torch.nn.LayerNorm(width), torch.nn.Linear(width, vocab, bias=False)

    def forward(self, x):
        return self.head(self.norm(x)), self.norm(x).sum(-1)


def test_a_large_output_of_a_final_gemm_leaves_fresh_not_cloned():
    """The head runs after the replay, outside the graph: each call's logits are its own tensor (not a clone, and
    not the graph's buffer), and a held result is not overwritten by the next call."""
    model, x = NormedHead().cuda(), torch.randn(64, 64, device="cuda")
    prog = stitchflow.compile(model, (x,), target="gpu", fusion="auto", options={"cuda_graphs": "always"})
    names, _ = prog._replay.tail_names, prog._replay.tail
    assert len(names) == 1
    held = []
    with torch.no_grad():
        for _ in range(5):
            fresh = torch.randn_like(x)
            got = prog(fresh)
            torch.testing.assert_close(got, model(fresh), rtol=1e-4, atol=1e-4)
            held.append((fresh, got))
        for fresh, got in held:
            torch.testing.assert_close(got, model(fresh), rtol=1e-4, atol=1e-4)
    assert prog._replay.graph is not None, prog._replay.failed
    static = {t.untyped_storage().data_ptr() for t in prog._replay.slots[0].static_env.values()
              if isinstance(t, torch.Tensor)}
    assert held[-1][1][0].untyped_storage().data_ptr() not in static
