"""Activations written out by hand, recognised (ir/activations.py): each formula becomes one tagged node
with the frontend's body, the graph's values stay eager's; near misses and shared intermediates stay as written."""

import math

import pytest
import torch
import torch.nn.functional as F

from stitchflow.frontend.capture import capture
from stitchflow.ir.activations import recognise_activations
from stitchflow.ir.interpret import run_graph
from stitchflow.program import capture_model


def gpt2_gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def bert_gelu(x):
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def cubed_gelu(x):  # the cube as products and the constant rounded, as some code writes it
    return x * 0.5 * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


def swish(x):
    return x / (1.0 + torch.exp(-x))


def sigmoid_swish(x):
    return x * torch.sigmoid(x)


WRITTEN = [(gpt2_gelu, "gelu", "tanh"), (bert_gelu, "gelu", "erf"), (cubed_gelu, "gelu", "tanh"),
           (swish, "silu", "sigmoid"), (sigmoid_swish, "silu", "sigmoid")]


def through_sin(activation):
    return lambda x: torch.sin(activation(torch.cos(x)))


def single_node(graph, kind):
    return [n for n in graph.nodes if n.tag is not None and n.tag.kind == kind]


def values(captured, graph, x):
    env = run_graph(graph, {**captured.param_values, graph.inputs[0]: x})
    return env[graph.outputs[0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("written,kind,op", WRITTEN, ids=[w[0].__name__ for w in WRITTEN])
def test_a_written_out_activation_becomes_its_node(written, kind, op, dtype):
    x = torch.randn(3, 7, 5, generator=torch.Generator().manual_seed(1)).to(dtype) * 3
    captured = capture_model(through_sin(written), (x,))
    graph = recognise_activations(captured.graph)
    (node,) = single_node(graph, kind)
    assert op in str(node.body)
    assert len(graph.nodes) == 3  # cos, the activation, sin
    got, want = values(captured, graph, x), through_sin(written)(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_the_recognised_node_is_the_one_the_frontend_lowers_the_activation_to():
    x = torch.randn(4, 6)
    written = recognise_activations(capture_model(through_sin(gpt2_gelu), (x,)).graph)
    library = capture_model(through_sin(lambda v: F.gelu(v, approximate="tanh")), (x,)).graph
    assert str(single_node(written, "gelu")[0].body) == str(single_node(library, "gelu")[0].body)


@pytest.mark.parametrize("near", [
    lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.04 * torch.pow(x, 3.0)))),
    lambda x: x * torch.sigmoid(1.702 * x),  # the "quick" GELU: another function
    lambda x: x * 0.5 * (1.0 + torch.erf(x / 1.5)),
], ids=["wrong-constant", "quick-gelu", "wrong-scale"])
def test_near_misses_stay_as_written(near):
    x = torch.randn(5, 3)
    captured = capture_model(through_sin(near), (x,))
    graph = recognise_activations(captured.graph)
    assert not single_node(graph, "gelu") and not single_node(graph, "silu")
    assert graph is captured.graph


def test_an_intermediate_read_outside_keeps_the_formula():
    def shared(x):
        t = torch.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3))
        return 0.5 * x * (1.0 + t) + t

    x = torch.randn(4, 4)
    captured = capture_model(shared, (x,))
    graph = recognise_activations(captured.graph)
    assert not single_node(graph, "gelu")
    torch.testing.assert_close(values(captured, graph, x), shared(x))


def test_two_values_in_the_formula_are_not_an_activation():
    def two(x, y):
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (y + 0.044715 * y ** 3)))

    x, y = torch.randn(4, 4), torch.randn(4, 4)
    captured = capture(torch.fx.symbolic_trace(two), (x, y))
    assert recognise_activations(captured.graph) is captured.graph
