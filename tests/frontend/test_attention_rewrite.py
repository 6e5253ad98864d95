"""Attention written as products and a softmax, found in Dynamo graphs and rewritten into
F.scaled_dot_product_attention (frontend/attention_rewrite.py; the training path uses it)."""

import copy
import math
import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import stitchflow.backend as backend
from stitchflow.frontend import attention_rewrite as ar
from conftest import assert_close, dynamo_graph


def causal_mask(s, dtype=torch.float32, fill=-math.inf):
    return torch.triu(torch.full((s, s), fill, dtype=dtype), diagonal=1)


class Attn(torch.nn.Module):
    """softmax(q @ k^T <scale> <mask>) @ v in the spelling `scale` / `mask` name."""

    def __init__(self, s, scale="mul", mask="none", dropout=0.0):
        super().__init__()
        self.scale, self.mask, self.dropout = scale, mask, dropout
        self.register_buffer("causal", causal_mask(s))

    def forward(self, q, k, v, m=None):
        scores = q @ k.transpose(-2, -1)
        if self.scale == "mul":
            scores = scores * 0.3
        elif self.scale == "rmul":
            scores = 0.3 * scores
        elif self.scale == "div":
            scores = scores / 4.0
        if self.mask == "additive":
            scores = scores + m
        elif self.mask == "causal":
            scores = scores + self.causal
        elif self.mask == "filled":
            scores = scores.masked_fill(m, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        if self.dropout:
            p = F.dropout(p, self.dropout, self.training)
        return p @ v


def qkv(batch, s=8, d=4, kv_batch=None, dtype=torch.float32):
    kvb = batch if kv_batch is None else kv_batch
    return (torch.randn(*batch, s, d, dtype=dtype), torch.randn(*kvb, s, d, dtype=dtype),
            torch.randn(*kvb, s, d + 1, dtype=dtype))


def rewrite_and_compare(model, *inputs, masked=True, causal=True, expect=1):
    gm, example = dynamo_graph(model, *inputs)
    new, done, refused = ar.rewritten(gm, example, causal=causal, masked=masked)
    assert len(done) == expect, refused
    assert sum(n.target is F.scaled_dot_product_attention for n in new.graph.nodes) == expect
    assert not any(ar._is(n, ar._SOFTMAX) for n in new.graph.nodes) or expect == 0
    assert_close(new(*example)[0] if isinstance(new(*example), tuple) else new(*example), model(*inputs))
    return done


@pytest.mark.parametrize("scale", ["mul", "rmul", "div", "none"])
def test_unmasked_attention_of_every_scale_spelling_is_rewritten(scale):
    q, k, v = qkv((2, 3))
    done = rewrite_and_compare(Attn(8, scale), q, k, v)
    assert done[0].mask is None and done[0].scale == pytest.approx({"mul": 0.3, "rmul": 0.3, "div": 0.25,
                                                                     "none": 1.0}[scale])


def test_a_causal_buffer_becomes_is_causal():
    q, k, v = qkv((2, 3))
    gm, example = dynamo_graph(Attn(8, mask="causal"), q, k, v)
    new, done, _ = ar.rewritten(gm, example)
    assert done[0].causal is not None
    call = next(n for n in new.graph.nodes if n.target is F.scaled_dot_product_attention)
    assert call.kwargs.get("is_causal") is True and "attn_mask" not in call.kwargs
    assert_close(new(*example)[0], Attn(8, mask="causal")(q, k, v))


def test_causal_off_passes_the_buffer_as_a_mask():
    q, k, v = qkv((2, 3))
    rewrite_and_compare(Attn(8, mask="causal"), q, k, v, causal=False)


def test_grouped_heads_broadcast_against_their_kv_head():
    """Llama's GQA spelling: q (B, KV, G, S, D) against k, v (B, KV, 1, S, D)."""
    q, k, v = qkv((2, 2, 3), kv_batch=(2, 2, 1))
    rewrite_and_compare(Attn(8, mask="causal"), q, k, v)
    rewrite_and_compare(Attn(8), q, k, v)


@pytest.mark.parametrize("batch", [(3,), (2, 3), (2, 2, 3)])
def test_explicit_masks_are_rewritten_only_when_asked(batch):
    q, k, v = qkv(batch)
    m = torch.where(torch.rand(*batch[:1], *([1] * (len(batch) - 1)), 1, 8) < 0.3, -math.inf, 0.0)
    rewrite_and_compare(Attn(8, mask="additive"), q, k, v, m)
    rewrite_and_compare(Attn(8, mask="additive"), q, k, v, m, masked=False, expect=0)
    filled = torch.rand(8, 8) < 0.3
    filled.fill_diagonal_(False)
    rewrite_and_compare(Attn(8, mask="filled"), q, k, v, filled)


@pytest.mark.parametrize("model, reason", [
    (lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1), dim=-2) @ v, "not the last"),
    (lambda q, k, v: (torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v, q @ k.transpose(-2, -1) * 2)[0], None),
    (lambda q, k, v: torch.softmax(q @ k, dim=-1) @ v.transpose(-2, -1), "last two axes"),
    (lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1), dim=-1, dtype=torch.float64) @ v.double(), "computed in"),
])
def test_what_is_not_an_attention_stays_with_its_reason(model, reason):
    q, k, v = qkv((2,), s=4, d=4)
    v = v[..., :4]
    gm, example = dynamo_graph(model, q, k, v)
    _, done, refused = ar.rewritten(gm, example)
    if reason is None:  # the second output's scores are its own product: the attention itself is rewritten
        assert len(done) == 1
        return
    assert not done and reason in str(refused[0]), refused


def test_scores_read_twice_are_kept():
    def model(q, k, v):
        s = q @ k.transpose(-2, -1)
        return torch.softmax(s, dim=-1) @ v, s
    gm, example = dynamo_graph(model, *qkv((2,)))
    _, done, refused = ar.rewritten(gm, example)
    assert not done and "read 2 times" in str(refused[0])


def test_dropout_in_training_is_refused_and_p0_passes():
    q, k, v = qkv((2, 3))
    gm, example = dynamo_graph(Attn(8, dropout=0.1).train(), q, k, v)
    _, done, refused = ar.rewritten(gm, example)
    assert not done and "dropout with p=0.1" in str(refused[0])
    rewrite_and_compare(Attn(8, dropout=0.1).eval(), q, k, v)


def test_is_causal_additive():
    assert ar.is_causal(causal_mask(5), 5)
    assert ar.is_causal(causal_mask(5, torch.bfloat16, torch.finfo(torch.bfloat16).min)[None, None], 5)
    assert not ar.is_causal(causal_mask(5).T, 5)
    assert not ar.is_causal(torch.triu(torch.full((5, 5), -math.inf), diagonal=2), 5)
    m = causal_mask(5)
    m[3, 1] = 1.0
    assert not ar.is_causal(m, 5)
    assert not ar.is_causal(causal_mask(5).expand(2, 5, 5), 5)
    assert not ar.is_causal(causal_mask(5), 4)


@settings(max_examples=25, deadline=None)
@given(batch=st.sampled_from([(1,), (3,), (2, 3), (1, 4), (2, 2, 2)]), s=st.integers(2, 9), d=st.integers(1, 6),
       scale=st.sampled_from(["mul", "rmul", "div", "none"]), mask=st.sampled_from(["none", "causal", "additive"]),
       gqa=st.booleans(), seed=st.integers(0, 2**16))
def test_rewrites_compute_what_the_graph_computed(batch, s, d, scale, mask, gqa, seed):
    torch.manual_seed(seed)
    kv_batch = (*batch[:-1], 1) if gqa and len(batch) > 1 else batch
    q, k, v = qkv(batch, s, d, kv_batch)
    m = torch.where(torch.rand(s, s) < 0.3, -math.inf, 0.0).fill_diagonal_(0.0)
    inputs = (q, k, v, m) if mask == "additive" else (q, k, v)
    rewrite_and_compare(Attn(s, scale, mask), *inputs)


def _llama(seed=0):
    from stitchflow.apps.transformer import llama_preset
    return llama_preset("llama3-8b", width=32, heads=4, kv_heads=2, ffn=48, seq=8, seed=seed)


def _train_step(fn, model, x, g):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(g)
    return y.detach(), x.grad, [p.grad for p in model.parameters()]


def _assert_same_step(a, b):
    assert_close(a[0], b[0])
    assert_close(a[1], b[1])
    for ga, gb in zip(a[2], b[2]):
        assert_close(ga, gb)


def test_llama_trains_through_torch_attention_with_eagers_gradients():
    backend.reset()
    model, ref = _llama(), _llama()
    fast = torch.compile(model, backend="stitchflow")
    for _ in range(2):
        x, g = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
        _assert_same_step(_train_step(fast, model, x, g), _train_step(ref, ref, x, g))
    assert backend.FALLBACKS == []


def test_a_causal_mask_written_in_place_sends_calls_to_the_masked_graph():
    backend.reset()
    model, ref = _llama(), _llama()
    fast = torch.compile(model, backend="stitchflow")
    x, g = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    _assert_same_step(_train_step(fast, model, x, g), _train_step(ref, ref, x, g))
    for m in (model, ref):  # attend to the future too: the guard must notice
        m.attn.causal_mask.zero_()
    _assert_same_step(_train_step(fast, model, x, g), _train_step(ref, ref, x, g))


def test_attention_option_false_keeps_the_graph_as_written():
    backend.reset()
    model, ref = _llama(), _llama()
    fast = torch.compile(model, backend="stitchflow", options={"attention": False})
    x, g = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    _assert_same_step(_train_step(fast, model, x, g), _train_step(ref, ref, x, g))
    assert copy.copy(backend.FALLBACKS) == []


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_grouped_heads_in_16_bits_are_read_in_place(mask):
    """k and v of one head per group go to torch's attention as they are (enable_gqa), not expanded."""
    q, k, v = qkv((2, 2, 3), s=16, d=8, kv_batch=(2, 2, 1), dtype=torch.bfloat16)
    model = Attn(16, mask=mask).to(torch.bfloat16)
    gm, example = dynamo_graph(model, q, k, v)
    new, done, _ = ar.rewritten(gm, example)
    call = next(n for n in new.graph.nodes if n.target is F.scaled_dot_product_attention)
    assert call.kwargs.get("enable_gqa") is True
    assert not any(n.target == "expand" for n in new.graph.nodes)
    truth = model.double()(q.double(), k.double(), v.double())
    got, eager = new(*example)[0].double(), model.to(torch.bfloat16)(q, k, v).double()
    assert (got - truth).norm() <= 2 * (eager - truth).norm() + 1e-3


class NanoGPTAttention(torch.nn.Module):
    """The causal self-attention of nanoGPT's spelling: a buffer of ones' lower triangle, sliced and
    compared with 0 for masked_fill."""

    def __init__(self, s, from_constants=False):
        super().__init__()
        self.from_constants = from_constants
        self.register_buffer("bias", torch.tril(torch.ones(s, s)).view(1, 1, s, s))

    def forward(self, q, k, v):
        t = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        hidden = torch.ones(t, t, dtype=torch.bool).triu(1) if self.from_constants else self.bias[:, :, :t, :t] == 0
        att = att.masked_fill(hidden, float("-inf"))
        return F.softmax(att, dim=-1) @ v


@pytest.mark.parametrize("from_constants", [False, True])
def test_a_mask_computed_from_a_buffer_or_constants_is_found_causal(from_constants):
    q, k, v = qkv((2, 3))
    model = NanoGPTAttention(12, from_constants)
    gm, example = dynamo_graph(model, q, k, v)
    new, done, refused = ar.rewritten(gm, example)
    assert len(done) == 1 and done[0].causal is not None, refused
    assert done[0].causal.positions == (() if from_constants else (done[0].causal.positions[0],))
    call = next(n for n in new.graph.nodes if n.target is F.scaled_dot_product_attention)
    assert call.kwargs.get("is_causal") is True
    assert_close(new(*example)[0], model(q, k, v))


def test_a_mask_passed_as_an_argument_is_no_causal_mask():
    """An activation may change every call: checking it again would cost a device sync each time."""
    q, k, v = qkv((2, 3))
    gm, example = dynamo_graph(Attn(8, mask="additive"), q, k, v, causal_mask(8))
    _, done, refused = ar.rewritten(gm, example)
    assert not done and ar.MASKED_SLOWER in str(refused[0])


class _NanoBlock(torch.nn.Module):
    def __init__(self, width=16, heads=2, s=8):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.attn = NanoGPTAttention(s)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        return self.out(self.attn(q, k, v).transpose(1, 2).flatten(-2))


def test_nanogpt_block_trains_causal_and_notices_its_buffer_written():
    backend.reset()
    torch.manual_seed(0)
    model = _NanoBlock()
    ref = copy.deepcopy(model)
    fast = torch.compile(model, backend="stitchflow")
    x, g = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    _assert_same_step(_train_step(fast, model, x, g), _train_step(ref, ref, x, g))
    for m in (model, ref):
        m.attn.bias.fill_(1.0)  # no mask at all now
    _assert_same_step(_train_step(fast, model, x, g), _train_step(ref, ref, x, g))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch's flash/cuDNN attention)")
def test_llama_trains_in_bf16_on_cuda_as_close_to_float64_as_eager():
    backend.reset()
    model = _llama().to("cuda", torch.bfloat16)
    ref, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    fast = torch.compile(model, backend="stitchflow")
    x, g = torch.randn(2, 8, 32, device="cuda"), torch.randn(2, 8, 32, device="cuda")
    got = _train_step(fast, model, x.bfloat16(), g.bfloat16())
    eager = _train_step(ref, ref, x.bfloat16(), g.bfloat16())
    truth = _train_step(exact, exact, x.double(), g.double())
    for a, e, t in zip([got[0], got[1], *got[2]], [eager[0], eager[1], *eager[2]], [truth[0], truth[1], *truth[2]]):
        err = (a.double() - t).norm() / t.norm()
        assert err <= max(2e-2, 2 * (e.double() - t).norm() / t.norm()), err


class HFAttention(torch.nn.Module):
    """Hugging Face's eager attention: the softmax in float32, cast back to the query's dtype."""

    def forward(self, q, k, v):
        w = torch.matmul(q, k.transpose(2, 3)) * 0.25
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        w = F.dropout(w, p=0.0, training=self.training)
        return torch.matmul(w, v)


def test_a_float32_softmax_cast_back_is_rewritten():
    q, k, v = qkv((2, 3), s=16, d=8, dtype=torch.bfloat16)
    model = HFAttention()
    gm, example = dynamo_graph(model, q, k, v)
    new, done, refused = ar.rewritten(gm, example)
    assert len(done) == 1, refused
    truth = model(q.double(), k.double(), v.double())
    got, eager = new(*example)[0].double(), model(q, k, v).double()
    assert (got - truth).norm() <= 2 * (eager - truth).norm() + 1e-3


def test_a_float32_softmax_kept_in_float32_is_refused():
    def model(q, k, v):
        return F.softmax(q @ k.transpose(-2, -1), dim=-1, dtype=torch.float32) @ v.float()
    gm, example = dynamo_graph(model, *qkv((2,), dtype=torch.bfloat16))
    _, done, refused = ar.rewritten(gm, example)
    assert not done and "cast back" in str(refused[0])


def test_a_mask_compared_by_its_dunder_method_is_evaluated():
    """torch 2.11's Dynamo records `t == 0` as the method __eq__, which is not an in-place op."""
    q, k, v = qkv((2, 3))
    model = NanoGPTAttention(8)
    gm, example = dynamo_graph(model, q, k, v)
    eq = next(n for n in gm.graph.nodes if n.target in (operator.eq, "__eq__"))
    if eq.target is operator.eq:  # torch 2.13 records operator.eq: spell it as 2.11 does
        with gm.graph.inserting_before(eq):
            dunder = gm.graph.call_method("__eq__", eq.args)
        dunder.meta.update(eq.meta)
        eq.replace_all_uses_with(dunder)
        gm.graph.erase_node(eq)
        gm.recompile()
    _, done, refused = ar.rewritten(gm, example)
    assert len(done) == 1 and done[0].causal is not None, refused
