"""F.scaled_dot_product_attention: captured as scores, a masked and scaled transform, a softmax and a
product with V; equal to eager with and without masks (boolean, additive, causal), scales, grouped
key/value heads and fully masked queries, in float32 and bfloat16, on the reference and gpu targets; on
the gpu target it runs as the attention kernel."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import stitchflow
from conftest import assert_close, skip_unless_kernels_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TARGETS = ["reference", "gpu"]


def _compile(fn, inputs, target):
    skip_unless_kernels_run(target)
    return stitchflow.compile(fn, inputs, target=target)


@pytest.mark.parametrize("target", TARGETS)
@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 2), heads=st.sampled_from([1, 2, 4]), length=st.integers(1, 9), keys=st.integers(1, 9),
       dim=st.sampled_from([4, 8, 16]), mask=st.sampled_from(["none", "bool", "float", "causal"]),
       scale=st.sampled_from([None, 0.3]), grouped=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_attention_equals_eager(target, batch, heads, length, keys, dim, mask, scale, grouped, dtype):
    g = torch.Generator().manual_seed(length * 100 + keys)
    kv_heads = 1 if grouped else heads
    q = torch.randn(batch, heads, length, dim, generator=g)
    k, v = torch.randn(batch, kv_heads, keys, dim, generator=g), torch.randn(batch, kv_heads, keys, dim + 3, generator=g)
    kwargs = {"scale": scale, "enable_gqa": grouped}
    if mask == "bool":
        kwargs["attn_mask"] = torch.rand(length, keys, generator=g) > 0.4  # rows with no key kept give zeros
    elif mask == "float":
        kwargs["attn_mask"] = torch.where(torch.rand(batch, 1, length, keys, generator=g) > 0.3,
                                          torch.randn(batch, 1, length, keys, generator=g), -math.inf).to(dtype)
    elif mask == "causal":
        kwargs["is_causal"] = True

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    inputs = tuple(t.to(dtype) for t in (q, k, v))
    if target == "gpu":
        inputs = tuple(t.to(DEVICE) for t in inputs)
        kwargs = {n: (a.to(DEVICE) if isinstance(a, torch.Tensor) else a) for n, a in kwargs.items()}
    prog = _compile(fn, inputs, target)
    assert_close(prog(*inputs), fn(*inputs))


def test_the_gpu_target_runs_it_as_one_attention_kernel():
    q = torch.randn(1, 2, 32, 16, device=DEVICE)
    mask = torch.rand(32, 32, device=DEVICE) > 0.5
    prog = _compile(lambda q: F.scaled_dot_product_attention(q, q, q, attn_mask=mask), (q,), "gpu")
    assert "attention scaled_dot_product_attention_scores .. scaled_dot_product_attention " in prog.explain()


@pytest.mark.parametrize("target", ["reference", "gpu"])
def test_dropout_drops_probabilities_and_rescales_the_rest(target):
    """With v the identity, each output row is its query's probabilities after dropout: every one either dropped or
    eager's probability scaled by 1 / (1 - p)."""
    skip_unless_kernels_run(target)
    device = "cuda" if target == "gpu" and torch.cuda.is_available() else "cpu"
    q, v = torch.randn(2, 3, 16, 16, device=device), torch.eye(16, device=device).expand(2, 3, 16, 16)
    fn = lambda q, v: F.scaled_dot_product_attention(q, q, v, dropout_p=0.3)  # noqa: E731
    with torch.no_grad():
        got = stitchflow.compile(fn, (q, v), target=target)(q, v)
    probs = F.scaled_dot_product_attention(q, q, v)
    kept = got != 0
    assert abs(kept.float().mean().item() - 0.7) < 0.05
    assert_close(got[kept], probs[kept] / 0.7)


def test_the_backend_captures_attention_whole():
    import stitchflow.backend as backend

    torch._dynamo.reset()
    backend.reset()
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 5, 16)

    def block(x):  # what HF models call: q, k, v projections, heads, SDPA, output projection
        q, k, v = (t.view(2, 5, 2, 8).transpose(1, 2) for t in F.linear(x, layer.self_attn.in_proj_weight).chunk(3, -1))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 5, 16)
        return layer.norm1(x + F.linear(o, layer.self_attn.out_proj.weight))

    with torch.no_grad():
        assert_close(torch.compile(block, backend="stitchflow")(x), block(x))
    assert backend.FALLBACKS == []
    torch._dynamo.reset()
