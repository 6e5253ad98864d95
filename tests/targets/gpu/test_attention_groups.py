"""Attention as transformers' models write it, on the gpu target, on the CPU under the Triton interpreter: grouped
key/value heads (torch's enable_gqa: K and V read at h // G), causal masks built from positions (aranges), and
masks the call computes over (batch, query, key) (padding combined with causality), which go to torch's attention."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import stitchflow
from stitchflow.program import capture_model
from stitchflow.targets.gpu.attention import LIBRARY
from stitchflow.targets.gpu.attention_match import match_attention
from test_attention import attention_steps, rel_err  # (the same directory: the kernel tests' helpers)

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the gpu target's Triton kernels on CPU tensors, which needs "
                                       "TRITON_INTERPRET=1 (conftest sets it; runs on a GPU export 0)")


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


class PaddedCausal(torch.nn.Module):
    """transformers' mask for a padded batch: keep = padding[b, key] & (key <= query), computed in the forward."""

    def forward(self, q, k, v, lengths):
        rows, cols = torch.arange(q.shape[-2]), torch.arange(k.shape[-2])
        padding = cols[None, :] >= (k.shape[-2] - lengths)[:, None]  # left padding, as generation pads
        keep = padding[:, None, None, :] & (cols[None, :] <= rows[:, None])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)


def test_a_mask_the_call_computes_goes_to_torchs_attention():
    q, k, v = torch.randn(3, 4, 12, 8), torch.randn(3, 2, 12, 8), torch.randn(3, 2, 12, 8)
    lengths = torch.tensor([12, 7, 3])
    graph = capture_model(PaddedCausal(), (q, k, v, lengths)).graph
    (match,), _ = match_attention(graph, graph.params)
    assert match.call_mask is not None and match.groups == (1, 2)
    prog = stitchflow.compile(PaddedCausal(), (q, k, v, lengths), target="gpu", fusion="full")
    for lengths in (torch.tensor([12, 7, 3]), torch.tensor([1, 12, 5])):  # the mask is read when the call runs
        want = PaddedCausal()(q, k, v, lengths)
        assert rel_err(prog(q, k, v, lengths), want) < 1e-5  # NaN rows where eager has them
    (step,) = attention_steps(prog)
    assert step.chosen == LIBRARY


def test_a_padded_batch_of_a_hugging_face_llama():
    T = pytest.importorskip("transformers")
    import stitchflow.backend as backend

    torch._dynamo.reset()
    backend.reset()
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=128, vocab_size=256)).eval()
    ids, mask = torch.randint(0, 256, (2, 16)), torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0
    compiled = torch.compile(model, backend="stitchflow", options={"target": "gpu", "cuda_graphs": False})
    with torch.no_grad():
        got, want = compiled(input_ids=ids, attention_mask=mask).logits, model(input_ids=ids, attention_mask=mask).logits
    assert rel_err(got, want) < 1e-5 and backend.FALLBACKS == []
    steps = [s for m in backend.COMPILED for p in m.programs.values() if p for s in attention_steps(p)]
    assert [s.match.call_mask is not None for s in steps] == [True]


def test_queries_with_every_key_masked_are_left_to_torchs_attention():
    """Lowering SDPA zeroes the rows of queries whose every key is masked (torch's math backend answers 0). With a
    mask of the call, the attention runs on torch's own, which answers for those rows as eager does on the device
    (not zeros under cuDNN on a Hopper GPU): the zeroing is the attention step's, and no kernel reduces the mask."""
    from stitchflow.targets.gpu.runtime import GroupKernel

    q, k, v = torch.randn(3, 4, 12, 8), torch.randn(3, 2, 12, 8), torch.randn(3, 2, 12, 8)
    lengths = torch.tensor([12, 7, 3])
    prog = stitchflow.compile(PaddedCausal(), (q, k, v, lengths), target="gpu", fusion="full")
    (step,) = attention_steps(prog)
    kept, rows = step.match.zeroed
    assert step.match.result == rows and kept in step.nodes
    kernels = [n.name for run in prog.compiled for s in run.steps if isinstance(s, GroupKernel)
               for p in s.plans for n in p.nodes]
    assert kept not in kernels and rows not in kernels
    out = prog(q, k, v, lengths)
    assert rel_err(out, PaddedCausal()(q, k, v, lengths)) < 1e-5
    assert not out[2, :, :9].any() and out[2, :, 9:].abs().sum(-1).gt(0).all()  # 9 padded queries of the third

    (match,), _ = match_attention(prog.graph, prog.graph.params)
    alone = match.within(set(match.nodes) - {rows})  # the planner put the rows in another region
    assert alone.zeroed == () and alone.result == match.output and kept not in alone.nodes
    assert match.within(set(match.nodes) - {match.scores}) is None


class RotaryPadded(torch.nn.Module):
    """Q made fresh, heads-major, by an elementwise op (a rotary embedding's shape), a mask of the call, and the
    heads merged after the attention, as transformers' Llama writes them."""

    def forward(self, x, k, v, lengths, cos, sin):
        b, s, _ = x.shape
        q = x.view(b, s, 4, 8).transpose(1, 2)
        q = q * cos + torch.cat((-q[..., 4:], q[..., :4]), dim=-1) * sin
        cols = torch.arange(s)
        keep = (cols[None, :] >= (s - lengths)[:, None])[:, None, None, :] & (cols[None, :] <= cols[:, None])
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
        return o.transpose(1, 2).reshape(b, s, 32) * 2


def test_a_query_made_in_the_region_is_laid_out_as_torchs_attention_writes_its_output(monkeypatch):
    """Q is stored [batch, length, heads, width], the order of the merged heads' store, so that torch's attention
    (whose output follows Q's layout) writes the store's layout itself: no copy of the output, equal to eager."""
    from stitchflow.targets.gpu.attention import AttentionStep

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 12, 32, generator=g)
    k, v = torch.randn(3, 2, 12, 8, generator=g), torch.randn(3, 2, 12, 8, generator=g)
    cos, sin = torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g)
    lengths = torch.tensor([12, 7, 3])
    copies = []
    monkeypatch.setattr(AttentionStep, "_outputs", lambda self, device: copies.append(device) or {})
    prog = stitchflow.compile(RotaryPadded(), (x, k, v, lengths, cos, sin), target="gpu", fusion="full")
    (step,) = attention_steps(prog)
    assert step.store is not None and tuple(step.graph.type_of[step.match.q.tensor].shape) == (3, 12, 4, 8)
    for lengths in (torch.tensor([12, 7, 3]), torch.tensor([2, 12, 5])):
        want = RotaryPadded()(x, k, v, lengths, cos, sin)
        assert rel_err(prog(x, k, v, lengths, cos, sin), want) < 1e-5
    assert copies == []
    assert f"Q {step.match.q.tensor} stored with its axes in the order (0, 2, 1, 3)" in prog.explain()

    unchanged = stitchflow.compile(RotaryPadded(), (x, k, v, lengths, cos, sin), target="gpu", fusion="full",
                                   options={"query_layouts": False})
    (step,) = attention_steps(unchanged)
    assert tuple(step.graph.type_of[step.match.q.tensor].shape) == (3, 4, 12, 8)


def test_a_query_keeps_its_layout_where_the_region_does_not_own_it():
    from stitchflow.targets.gpu.operand_layouts import permute_values, why_fixed

    x, k, v = torch.randn(2, 6, 32), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    cos, sin, lengths = torch.randn(6, 8), torch.randn(6, 8), torch.tensor([6, 4])
    graph = capture_model(RotaryPadded(), (x, k, v, lengths, cos, sin)).graph
    (match,), _ = match_attention(graph, graph.params)
    q = match.q.tensor
    everything = {n.name for n in graph.nodes}
    assert why_fixed(graph, q, everything) is None
    assert "outside the region" in why_fixed(graph, q, everything - {match.scores})
    assert "not made by an elementwise node" in why_fixed(graph, q, everything - {q})
    assert "input or output" in why_fixed(graph, graph.inputs[0], everything)
    permuted = permute_values(graph, {q: (0, 2, 1, 3)})
    assert tuple(permuted.type_of[q].shape) == (2, 6, 4, 8)
    assert all(a.indices == tuple(b.indices[i] for i in (0, 2, 1, 3))
               for a, b in zip((a for a in permuted.node_of[match.scores].accesses if a.tensor == q),
                               (b for b in graph.node_of[match.scores].accesses if b.tensor == q)))


class TwoLayers(torch.nn.Module):
    """Two attentions under one mask of the call, as the layers of a padded language model."""

    def forward(self, q, k, v, lengths):
        rows, cols = torch.arange(q.shape[-2]), torch.arange(k.shape[-2])
        padding = cols[None, :] >= (k.shape[-2] - lengths)[:, None]
        keep = padding[:, None, None, :] & (cols[None, :] <= rows[:, None])
        once = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
        return F.scaled_dot_product_attention(once * 0.5 + q, k, v, attn_mask=keep, enable_gqa=True)


def test_the_layers_of_one_call_share_its_combined_mask(monkeypatch):
    from stitchflow.targets.gpu.attention import AttentionStep

    made = []
    bias = AttentionStep._combined_mask
    monkeypatch.setattr(AttentionStep, "_combined_mask", lambda self, *a: made.append(1) or bias(self, *a))
    q, k, v = torch.randn(3, 4, 12, 8), torch.randn(3, 2, 12, 8), torch.randn(3, 2, 12, 8)
    prog = stitchflow.compile(TwoLayers(), (q, k, v, torch.tensor([12, 7, 3])), target="gpu", fusion="full")
    assert len(attention_steps(prog)) == 2
    for lengths in (torch.tensor([12, 7, 3]), torch.tensor([1, 12, 5])):
        made.clear()
        assert rel_err(prog(q, k, v, lengths), TwoLayers()(q, k, v, lengths)) < 1e-5
        assert made == [1]
