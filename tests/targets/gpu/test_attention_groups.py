"""Grouped key/value heads (torch's enable_gqa, as transformers' Llama calls it: K and V read at h // G) and
causal masks built from positions (aranges, as transformers builds them) on the gpu target's attention kernel,
on the CPU under the Triton interpreter."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import stitchflow
from stitchflow.program import capture_model
from stitchflow.targets.gpu.attention import LIBRARY, AttentionStep, match_attention

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests on CPU tensors")


def attention_steps(prog) -> list[AttentionStep]:
    return [s for run in prog._compiled for s in getattr(run, "attention", ())]


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


class Grouped(torch.nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=True) * 2


class PositionMask(torch.nn.Module):
    """transformers' causal mask: key index <= query index, from aranges computed in the forward."""

    def forward(self, q, k, v):
        rows, cols = torch.arange(q.shape[-2]), torch.arange(k.shape[-2])
        keep = cols[None, :] <= rows[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)


@settings(max_examples=6, deadline=None)
@given(heads=st.sampled_from([(4, 2), (6, 3), (6, 1), (3, 3)]), seq=st.integers(5, 40), causal=st.booleans(),
       bf16=st.booleans())
def test_grouped_heads_run_on_the_attention_kernel(heads, seq, causal, bf16):
    dtype = torch.bfloat16 if bf16 else torch.float32
    h, kv = heads
    g = torch.Generator().manual_seed(seq)
    q = torch.randn(2, h, seq, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, kv, seq, 16, generator=g).to(dtype) for _ in range(2))
    model = Grouped(causal)
    prog = stitchflow.compile(model, (q, k, v), target="gpu", fusion="full")
    (step,) = attention_steps(prog)
    assert step.groups == ((1, h // kv) if kv < h else (1, 1))
    want = model(*(t.double() for t in (q, k, v)))
    assert rel_err(prog(q, k, v), want) < (2e-2 if bf16 else 1e-5)


@pytest.mark.parametrize("tiles", [None, LIBRARY])
def test_grouped_heads_through_torchs_attention_too(tiles):
    """The library form hands K and V over as H // G heads with enable_gqa, Q whole."""
    q, k, v = torch.randn(1, 6, 24, 8), torch.randn(1, 2, 24, 8), torch.randn(1, 2, 24, 8)
    options = {"attention_tiles": tiles} if tiles else {}
    prog = stitchflow.compile(Grouped(True), (q, k, v), target="gpu", fusion="full", options=options)
    (step,) = attention_steps(prog)
    assert step.library_form() == (True, None)
    assert rel_err(prog(q, k, v), Grouped(True)(q, k, v)) < 1e-5


def test_a_mask_built_from_positions_folds_to_causal():
    q, k, v = torch.randn(1, 4, 20, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    graph = capture_model(PositionMask(), (q, k, v)).graph
    (match,), refusals = match_attention(graph, graph.params)
    assert match.groups == (1, 2), refusals
    prog = stitchflow.compile(PositionMask(), (q, k, v), target="gpu", fusion="full")
    (step,) = attention_steps(prog)
    assert step.library_form() == (True, None)
    assert rel_err(prog(q, k, v), PositionMask()(q, k, v)) < 1e-5


def test_grouped_heads_under_the_torch_compile_backend():
    import stitchflow.backend as backend

    torch._dynamo.reset()
    backend.reset()
    q, k, v = torch.randn(2, 4, 17, 16), torch.randn(2, 2, 17, 16), torch.randn(2, 2, 17, 16)
    model = Grouped(True)
    out = torch.compile(model, backend="stitchflow", options={"target": "gpu", "cuda_graphs": False})(q, k, v)
    assert rel_err(out, model(q, k, v)) < 1e-5
    steps = [s for m in backend.COMPILED for p in m.programs.values() if p for s in attention_steps(p)]
    assert [s.groups for s in steps] == [(1, 2)]
