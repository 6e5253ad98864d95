"""Hugging Face transformers' models in the zoo, built from configurations (seeded random weights, nothing
downloaded) and called as their users call them: `model(input_ids=ids)`, the key/value cache on where the model
makes one, torch's scaled-dot-product attention (transformers' default). The zoo's own transformer apps are single
blocks written for this project; these are whole models written by others, so they show what the torch.compile
backend does with code it was not written against. They need the `transformers` package (the test extra).
"""

from __future__ import annotations

import torch
from torch import nn

from ..frontend.capture import LAYER_ELEMENTS

# name: (architecture, {size: configuration}, {size: (batch, tokens)})
HF_MODELS = {
    "hf-gpt2": ("GPT2LMHeadModel", {
        "small": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128),
        "default": dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024),  # GPT-2 (124M)
    }, {"small": (2, 16), "default": (4, 1024)}),
    "hf-llama": ("LlamaForCausalLM", {
        "small": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=256, max_position_embeddings=128),
        # Llama 3.2 1B's widths, 4 of its 16 layers
        "default": dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=8192, vocab_size=128256, max_position_embeddings=2048,
                        rope_theta=500000.0, tie_word_embeddings=True),
    }, {"small": (2, 16), "default": (1, 1024)}),
    "hf-opt": ("OPTForCausalLM", {
        "small": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, vocab_size=256,
                      max_position_embeddings=128, word_embed_proj_dim=64),
        # OPT-125m: a ReLU MLP over rows flattened by the model itself
        "default": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, ffn_dim=3072, vocab_size=50272,
                        max_position_embeddings=2048, word_embed_proj_dim=768),
    }, {"small": (2, 16), "default": (4, 1024)}),
    "hf-bert": ("BertModel", {
        "small": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                      vocab_size=256, max_position_embeddings=128),
        "default": dict(),  # BERT-base
    }, {"small": (2, 16), "default": (8, 512)}),
}
DROPOUT_KEYS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob", "dropout",
                "attention_dropout")


# Padded batches: sizes whose calls carry an `attention_mask` of sequences of different lengths, with the
# configuration of the size named here. Causal LMs are padded on the left, as batches for generation are; encoders
# on the right. The mask then reaches the attention as a (batch, query, key) tensor the call computes.
PADDED = {"small-padded": ("small", (3, 16)), "padded": ("default", (4, 512))}


class HFCall(nn.Module):
    """A transformers model called with `input_ids` (and an `attention_mask` where the batch is padded), returning
    its first output as a tensor (a causal LM's logits, an encoder's last hidden state): the form the zoo's
    benchmarks take."""

    # per-layer ("partial") fusion: a layer is an element of the model's layer list (GPT-2's transformer.h.0,
    # OPT's model.decoder.layers.0), whatever the wrappers around it
    partial_depth = LAYER_ELEMENTS

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


def padding_mask(batch: int, tokens: int, left: bool) -> torch.Tensor:
    """A (batch, tokens) mask of ones over each sequence: sequence i holds tokens - i·tokens // (2·batch) of them,
    so the first is whole and the last a little over half."""
    lengths = torch.tensor([tokens - i * tokens // (2 * batch) for i in range(batch)])[:, None]
    positions = torch.arange(tokens)[None, :]
    return (positions >= tokens - lengths if left else positions < lengths).long()


def build_hf(name: str, size: str = "small", seed: int = 0, dtype: torch.dtype = torch.float32, dropout: bool = False):
    """(HFCall(model).eval(), (input_ids,)) for zoo app `name` at `size`; dropout off unless asked (so that every
    runner of a training benchmark computes the same step)."""
    try:
        import transformers
    except ImportError as err:
        raise ImportError(f"{name} needs the transformers package (pip install transformers)") from err
    architecture, configs, shapes = HF_MODELS[name]
    config_size, shape = PADDED.get(size, (size, shapes.get(size)))
    if config_size not in configs:
        raise ValueError(f"{name}: unknown size {size!r}; known: {', '.join([*configs, *PADDED])}")
    config_class = getattr(transformers, architecture).config_class
    config = config_class(**configs[config_size])
    if not dropout:
        for key in DROPOUT_KEYS:
            if isinstance(getattr(config, key, None), float):
                setattr(config, key, 0.0)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(dtype)
    batch, tokens = shape
    ids = torch.randint(0, config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(seed + 7919))
    if size not in PADDED:
        return HFCall(model).eval(), (ids,)
    causal = architecture.endswith(("ForCausalLM", "LMHeadModel"))
    return HFCall(model).eval(), (ids, padding_mask(batch, tokens, left=causal))
