"""stitchflow.compile on transformers' models called as users call them: the key/value cache on, so that the
model returns a DynamicCache (an EncoderDecoderCache for T5 and BART) beside its logits. The program returns
the same structure, its cache holding the same keys and values as eager's, on the reference target and on the gpu
target (CUDA, or CPU tensors under TRITON_INTERPRET=1, as CI runs it). Skipped without transformers."""

import os

import pytest
import torch

import stitchflow
from conftest import assert_close, skip_unless_kernels_run

T = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=256,
             max_position_embeddings=128)
MODELS = {  # name: (model, positional inputs: ids, [mask, [decoder ids]])
    "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**SMALL, num_key_value_heads=2)), "ids mask"),
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128)),
             "ids"),  # GPT-2's second parameter is past_key_values
    "opt": (lambda: T.OPTForCausalLM(T.OPTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                 ffn_dim=128, vocab_size=256, max_position_embeddings=128,
                                                 word_embed_proj_dim=64)), "ids mask"),
    "t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                                                           vocab_size=256)), "ids mask decoder"),
}


def _inputs(kinds: str, seed: int, device: str) -> tuple:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0  # a left-padded second sequence
    inputs = {"ids": (ids,), "ids mask": (ids, mask), "ids mask decoder": (ids, mask, ids.flip(1))}[kinds]
    return tuple(x.to(device) for x in inputs)


def _device(target: str) -> str:
    """Where a target's test runs: CUDA for the gpu target on a GPU, else the CPU (the gpu target under the
    interpreter, as CI runs it)."""
    skip_unless_kernels_run(target)
    on_cuda = target == "gpu" and torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    return "cuda" if on_cuda else "cpu"


def _caches(cache) -> list[torch.Tensor]:
    """Every key and value tensor of a transformers cache, layer by layer (both halves of an encoder-decoder's)."""
    if isinstance(cache, T.EncoderDecoderCache):
        return _caches(cache.self_attention_cache) + _caches(cache.cross_attention_cache)
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_model_with_its_cache_compiles_and_equals_eager(name, target):
    device = _device(target)
    torch.manual_seed(0)
    make, kinds = MODELS[name]
    model = make().eval().to(device)
    with torch.no_grad():
        prog = stitchflow.compile(model, _inputs(kinds, 1, device), target=target, fusion="auto")
        fresh = _inputs(kinds, 2, device)
        want, got = model(*fresh), prog(*fresh)
    assert type(got) is type(want) and type(got.past_key_values) is type(want.past_key_values)
    assert_close(got.logits, want.logits)
    want_kv, got_kv = _caches(want.past_key_values), _caches(got.past_key_values)
    assert len(got_kv) == len(want_kv) > 0
    for g, w in zip(got_kv, want_kv):
        assert_close(g, w)
    assert got.past_key_values.get_seq_length() == want.past_key_values.get_seq_length() == 12


@pytest.mark.parametrize("target", ["reference", "gpu"])
def test_a_model_called_with_keywords_compiles_with_them(target):
    """transformers' models are called with keywords: compiled with example_kwargs, the program takes the same call."""
    device = _device(target)
    torch.manual_seed(0)
    model = MODELS["llama"][0]().eval().to(device)
    ids, mask = _inputs("ids mask", 1, device)
    with torch.no_grad():
        prog = stitchflow.compile(model, example_kwargs=dict(input_ids=ids, attention_mask=mask, use_cache=False),
                                  target=target)
        fresh, _ = _inputs("ids mask", 2, device)
        got = prog(input_ids=fresh, attention_mask=mask, use_cache=False)
        want = model(input_ids=fresh, attention_mask=mask, use_cache=False)
    assert got.past_key_values is None
    assert_close(got.logits, want.logits)
