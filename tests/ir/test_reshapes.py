"""Flattened rows split back (ir/reshapes.py): GEMMs over views, computed in their input's shape, equal the graph
they came from; every plain access stays plain; graph outputs, reductions over the rows and inputs keep their shape."""

import torch
from hypothesis import given, settings, strategies as st

from stitchflow.ir.interpret import run_graph
from stitchflow.ir.reshapes import unflatten_rows
from stitchflow.program import capture_model


class Conv1DMlp(torch.nn.Module):
    """GPT-2's MLP as transformers writes it: Conv1D flattens the rows, addmm, views them back."""

    def __init__(self, d: int, h: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(torch.randn(d, h, generator=g))
        self.b1 = torch.nn.Parameter(torch.randn(h, generator=g))
        self.w2 = torch.nn.Parameter(torch.randn(h, d, generator=g))

    def forward(self, x):
        lead, d = x.shape[:-1], x.shape[-1]
        h = torch.addmm(self.b1, x.reshape(-1, d), self.w1).view(*lead, -1)
        return (torch.relu(h).reshape(-1, h.shape[-1]) @ self.w2).view(*lead, d) + x


def plain_fraction(graph) -> tuple[int, int]:
    accesses = [a for n in graph.nodes for a in n.accesses]
    return sum(a.is_plain for a in accesses), len(accesses)


def outputs(captured, graph, *inputs):
    env = run_graph(graph, {**captured.param_values, **dict(zip(graph.inputs, inputs))})
    return [env[o] for o in graph.outputs]


def assert_same_values(captured, graph, *inputs):
    for got, want in zip(outputs(captured, graph, *inputs), outputs(captured, captured.graph, *inputs)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_gemms_of_a_conv1d_mlp_read_and_write_the_rows_unflattened():
    x = torch.randn(2, 5, 8)
    captured = capture_model(Conv1DMlp(8, 12), (x,))
    graph = unflatten_rows(captured.graph)
    gemms = [n for n in graph.nodes if n.reduce == "sum"]
    assert [len(n.index) for n in gemms] == [3, 3]
    assert all(a.is_plain for n in graph.nodes for a in n.accesses)
    assert plain_fraction(captured.graph)[0] < plain_fraction(graph)[0]
    assert graph.type_of[gemms[0].name].shape == (2, 5, 12)
    assert_same_values(captured, graph, x)


@settings(max_examples=25, deadline=None)
@given(lead=st.lists(st.integers(1, 5), min_size=1, max_size=3), d=st.integers(1, 9), h=st.integers(1, 9))
def test_any_leading_shape_gives_the_same_values(lead, d, h):
    x = torch.randn(*lead, d, generator=torch.Generator().manual_seed(sum(lead) + d + h))
    captured = capture_model(Conv1DMlp(d, h), (x,))
    graph = unflatten_rows(captured.graph)
    before, after = plain_fraction(captured.graph), plain_fraction(graph)
    assert after[0] >= before[0]
    assert_same_values(captured, graph, x)


def test_a_gemm_whose_flat_output_is_returned_keeps_its_shape():
    def flat(x, w):
        return x.reshape(-1, x.shape[-1]) @ w

    x, w = torch.randn(3, 4, 6), torch.randn(6, 7)
    captured = capture_model(flat, (x, w))
    assert unflatten_rows(captured.graph) is captured.graph


def test_a_sum_over_the_flat_rows_is_not_split():
    """A weight gradient's shape: sum over the flattened rows of both operands; splitting its rows would make
    its one reduction two, so the product that feeds it stays flat and its reads stay plain."""
    def grad(x, g, w):
        y = x.reshape(-1, x.shape[-1]) @ w
        return (y * g).t() @ x.reshape(-1, x.shape[-1])

    x, g, w = torch.randn(3, 4, 6), torch.randn(12, 5), torch.randn(6, 5)
    captured = capture_model(grad, (x, g, w))
    graph = unflatten_rows(captured.graph)
    assert plain_fraction(graph)[0] >= plain_fraction(captured.graph)[0]
    assert_same_values(captured, graph, x, g, w)


def test_merged_heads_split_the_projections_rows():
    """Attention's output projection reads its heads merged (rows apart in two axes); its output and the
    residual add after it get the batch and sequence axes back."""
    def project(o, w, r):
        b, h, t, e = o.shape
        y = o.transpose(1, 2).reshape(b * t, h * e) @ w
        return y.view(b, t, -1) + r

    o, w, r = torch.randn(2, 3, 4, 5), torch.randn(15, 6), torch.randn(2, 4, 6)
    captured = capture_model(project, (o, w, r))
    graph = unflatten_rows(captured.graph)
    assert plain_fraction(graph)[0] > plain_fraction(captured.graph)[0]
    assert_same_values(captured, graph, o, w, r)
