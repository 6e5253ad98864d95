"""(S·X)·W computed as S·(X·W) on the gpu target when W narrows X: the rewrite, where it does not apply,
and programs against eager."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import stitchflow
from stitchflow.ir.interpret import run_graph
from stitchflow.program import capture_model
from stitchflow.targets.gpu.reassociate import find_reassociations, reassociate

from conftest import random_sparse

interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="gpu programs on CPU tensors run under the interpreter "
                                      "(a GPU session runs the GNN apps in test_spmm_cuda.py)")


class Layer(torch.nn.Module):
    def __init__(self, f_in, f_out, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(f_in, f_out, generator=g) * f_in ** -0.5)
        self.bias = torch.nn.Parameter(torch.randn(f_out, generator=g))

    def forward(self, a, x):
        return torch.relu((a @ x) @ self.weight + self.bias)


class KeepsAX(Layer):
    def forward(self, a, x):
        ax = a @ x
        return (ax @ self.weight).sum() + ax.sum()


def inputs(n=53, f=40, density=0.1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return random_sparse(n, n, density, generator=g).to_sparse_csr(), torch.randn(n, f, generator=g)


def test_the_rewrite_puts_the_narrowing_gemm_first():
    a, x = inputs()
    captured = capture_model(Layer(40, 8), (a, x))
    graph = captured.graph
    (found,) = find_reassociations(graph, {n.name for n in graph.nodes})
    assert found.features == (40, 8) and found.sparse == "a"
    new = reassociate(graph, [found])
    assert new.type_of[found.inner].shape == (53, 8)
    assert "a[" in str(new.node_of[found.outer]) and "x[" in str(new.node_of[found.inner])
    env = run_graph(new, {"a": a, "x": x, **captured.param_values})
    assert torch.allclose(env[new.outputs[0]], Layer(40, 8)(a, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model,f_in,why", [
    (Layer(8, 16), 8, "widens"), (KeepsAX(40, 8), 40, "a·x is read twice")])
def test_where_it_does_not_apply(model, f_in, why):
    a, x = inputs(f=f_in)
    graph = capture_model(model, (a, x)).graph
    assert not find_reassociations(graph, {n.name for n in graph.nodes}), why


def test_a_dense_left_operand_is_not_reassociated():
    a, x = inputs()
    graph = capture_model(Layer(40, 8), (a.to_dense(), x)).graph
    assert not find_reassociations(graph, {n.name for n in graph.nodes})


@interpreter_only
@pytest.mark.parametrize("density", [0.02, 0.2, 0.6])
def test_gpu_programs_match_eager(density, caplog):
    model = Layer(40, 8)
    a, x = inputs(density=density)
    with caplog.at_level("INFO", logger="stitchflow.gpu"):
        prog = stitchflow.compile(model, (a, x), target="gpu", fusion="full")
    assert "gathers 8 features instead of 40" in caplog.text
    for seed in (1, 2):
        a, x = inputs(density=density, seed=seed)
        assert torch.allclose(prog(a, x), model(a, x), rtol=1e-5, atol=1e-5)
    off = stitchflow.compile(model, (a, x), target="gpu", fusion="full", options={"reassociate": False})
    assert torch.allclose(off(a, x), model(a, x), rtol=1e-5, atol=1e-5)


@interpreter_only
@pytest.mark.parametrize("app", ["gcn", "graphsage"])
def test_gnn_apps_on_cora(app):
    from stitchflow.apps import APPS

    model, (a, x) = APPS[app].build(size="default", dataset="cora")
    prog = stitchflow.compile(model, (a, x), target="gpu", fusion="auto")
    out, ref = prog(a, x), model(a, x)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    assert "gathers 16 features instead of 1433" in prog.explain()
