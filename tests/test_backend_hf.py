"""Hugging Face transformers' models under torch.compile(backend="stitchflow"): small random configurations of
the common architectures, as users call them (a causal LM's forward with its key/value cache on), compared with
eager, with nothing left to eager that has a lowering. Skipped where transformers is not installed."""

import copy

import pytest
import torch

import stitchflow.backend as backend
from conftest import assert_close

T = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=256,
             max_position_embeddings=128)
# name: (model, inputs); dropout off so that training steps compare with eager
MODELS = {
    "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**SMALL, num_key_value_heads=2)),
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**SMALL, num_key_value_heads=2)),
    "bert": lambda: T.BertModel(T.BertConfig(**SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                                                          vocab_size=256, dropout_rate=0.0)),
    "vit": lambda: T.ViTModel(T.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=128, image_size=32, patch_size=8)),
}


def _inputs(name: str) -> dict:
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)}
    ids = torch.randint(0, 256, (2, 16), generator=g)
    return {"input_ids": ids, "decoder_input_ids": ids.flip(1)} if name == "t5" else {"input_ids": ids}


def _first(out) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_inference_runs_through_stitchflow(name):
    torch.manual_seed(0)
    model, kwargs = MODELS[name]().eval(), _inputs(name)
    with torch.no_grad():
        expected = _first(model(**kwargs))
        got = _first(torch.compile(model, backend="stitchflow")(**kwargs))
    assert_close(got, expected)
    assert backend.FALLBACKS == [], backend.fallback_report()
    assert backend.regions_executed() >= 1


@pytest.mark.parametrize("name", ["llama", "mistral", "bert"])
def test_training_steps_get_eagers_gradients(name):
    """Two steps: Mistral's sliding-window slice (its gradient a slice scatter clamped to the sequence) and
    BERT's attention mask (expanded over heads) included."""
    torch.manual_seed(0)
    model, kwargs = MODELS[name]().train(), _inputs(name)
    reference = copy.deepcopy(model)
    weights = torch.randn(_first(reference(**kwargs)).shape, generator=torch.Generator().manual_seed(2))
    (_first(reference(**kwargs)) * weights).sum().backward()
    compiled = torch.compile(model, backend="stitchflow")
    for _ in range(2):
        model.zero_grad()
        loss = (_first(compiled(**kwargs)) * weights).sum()
        loss.backward()
    for (path, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            continue
        # a key projection's bias gets a zero gradient (softmax ignores a shift per query) up to rounding
        atol = 1e-4 * max(1.0, q.grad.abs().max().item())
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=atol, msg=lambda m: f"{path}: {m}")
    assert backend.FALLBACKS == [], backend.fallback_report()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["hf-llama", "hf-gpt2"])
def test_left_padded_batches_equal_eager_on_the_gpu(name):
    """Left padding leaves the padded queries of a causal LM no key to attend to. Torch's attention answers for them
    per backend (cuDNN's answer is not the zeros of the math kernel), and eager's answer is carried through every
    later layer: the compiled model must give the same, which tests on the CPU cannot see."""
    from stitchflow.apps import build_model

    torch._dynamo.reset()
    backend.reset()
    model, inputs = build_model(name, "small-padded", dtype=torch.bfloat16)
    model, inputs = model.cuda(), [x.cuda() for x in inputs]
    compiled = torch.compile(model, backend="stitchflow", dynamic=False)
    with torch.no_grad():
        want, got = model(*inputs), compiled(*inputs)
    assert backend.FALLBACKS == []
    assert ((got.double() - want.double()).norm() / want.double().norm()).item() < 2e-2


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_through_a_compiled_forward_equals_eager(cache):
    """`model.forward = torch.compile(...)` then `generate`: with the default cache every step has a longer key/value
    length (Dynamo traces for dynamic shapes from the second; each length is a program of its own); with the static
    cache the shapes hold, and the cache's length tensor is advanced in place (`.to(device)` then `add_`), written
    back into the caller's tensor after each step."""
    torch.manual_seed(0)
    model = MODELS["llama"]().eval()
    ids = _inputs("llama")["input_ids"][:, :6]
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation=cache)
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), **options)
        model.forward = torch.compile(model.forward, backend="stitchflow")
        got = model.generate(ids, attention_mask=torch.ones_like(ids), **options)
    assert torch.equal(got, expected)
    assert backend.FALLBACKS == [], backend.fallback_report()
