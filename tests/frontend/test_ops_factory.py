"""Tensors made from nothing inside a model (zeros, full, arange, eye, linspace): computed where they are used
on the reference and gpu targets, folded to constant inputs on the dataflow target; equal to eager on every
target and through torch.compile(backend="stitchflow") without a fallback. Also a slice read by a matmul."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import stitchflow
from stitchflow import backend
from conftest import assert_close, skip_unless_kernels_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = {
    "positions": lambda x: x + torch.arange(x.shape[1], device=x.device),
    "float_arange": lambda x: x * torch.arange(2, 2 + 3 * x.shape[1], 3, dtype=x.dtype, device=x.device),
    "descending": lambda x: x + torch.arange(10, 10 - x.shape[1], -1, device=x.device),
    "fractional_step": lambda x: x * torch.arange(0, 0.1 * x.shape[1] - 1e-6, 0.1, device=x.device),
    "filled": lambda x: x + torch.zeros(x.shape[1], device=x.device) + torch.ones(x.shape, device=x.device) * 2
    + torch.full((1, x.shape[1]), 3.5, device=x.device),
    "integer_ones": lambda x: (x > 0).long() + torch.ones(x.shape, dtype=torch.long, device=x.device),
    "identity": lambda x: x[:, :3] @ torch.eye(3, device=x.device) + torch.eye(x.shape[0], 3, device=x.device),
    "spaced": lambda x: x * torch.linspace(0, 1, x.shape[1], device=x.device),
    "causal_mask": lambda x: x.masked_fill(
        torch.arange(x.shape[1], device=x.device)[None, :] > torch.arange(x.shape[0], device=x.device)[:, None], 0),
    "sliced_matmul": lambda x: (x[:, 1:4] @ x[:3, :]).relu() @ x[:2, :].T,
}


@pytest.mark.parametrize("target", ["reference", "gpu", "dataflow"])
@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=2, deadline=None)
@given(rows=st.integers(3, 9), cols=st.integers(4, 11))
def test_made_tensors_equal_eager(name, target, rows, cols):
    skip_unless_kernels_run(target)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * 16 + cols))
    if target == "gpu":
        x = x.to(DEVICE)
    fn = CASES[name]
    prog = stitchflow.compile(fn, (x,), target=target, fusion="full")
    assert_close(prog(x), fn(x))
    if target == "dataflow":  # coordinates alone became constant inputs
        assert not any(n.name.startswith(("arange", "eye")) for n in prog.graph.nodes)


def test_made_tensors_are_computed_not_stored():
    """An arange, a fill and an identity are nodes (no constant input holds their values); a fractional
    arange and a linspace, whose values eager computes in double precision, are stored."""
    x = torch.randn(4, 6)
    # sizes read from the input, as a model does (symbolic tracing runs a call of literals itself)
    prog = stitchflow.compile(lambda x: x + torch.arange(x.shape[1]) + torch.full(x.shape, 2.0)
                              + torch.eye(x.shape[0], x.shape[1]), (x,))
    assert prog.graph.params == ()
    prog = stitchflow.compile(lambda x: x * torch.linspace(0, 1, x.shape[1]), (x,))
    assert len(prog.graph.params) == 1


def test_positions_compile_through_the_backend_without_fallback():
    class Embedded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 8)

        def forward(self, x):
            pos = torch.arange(x.shape[1], device=x.device)
            return torch.atan2(x + self.emb(pos), x.flip(-1)).sinh()

    model, x = Embedded(), torch.randn(2, 10, 8)
    backend.reset()
    torch._dynamo.reset()
    out = torch.compile(model, backend="stitchflow")(x)
    assert_close(out, model(x))
    assert backend.FALLBACKS == [], backend.fallback_report()
    assert backend.regions_executed() > 0


def _filled_buffers(x):
    """Buffers made in a layout of their own and then written whole (a MoE layer's output buffer, AOTAutograd's
    empty_permuted): what they held before does not show."""
    a = torch.empty_strided((x.shape[1], x.shape[0]), (1, x.shape[1]), device=x.device)
    a[:] = x.T * 2
    b = torch.ops.aten.empty_permuted((x.shape[0], x.shape[1]), (1, 0), device=x.device)
    b[...] = x.relu()
    return a.T + b


@pytest.mark.usefixtures("fresh_dynamo")
def test_strided_and_permuted_empty_buffers_compile_without_fallback():
    x = torch.randn(5, 7)
    assert_close(stitchflow.compile(_filled_buffers, (x,))(x), _filled_buffers(x))
    assert_close(torch.compile(_filled_buffers, backend="stitchflow")(x), _filled_buffers(x))
    assert not backend.FALLBACKS, backend.fallback_report()
