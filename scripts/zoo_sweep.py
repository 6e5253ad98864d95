"""Robustness sweep: models users bring (transformers architectures at small widths, torchvision CNNs and ViTs)
through torch.compile(backend="stitchflow"), each output (and in training each gradient) compared with eager's
on the same inputs. Prints one line per model and run: ok / MISMATCH / ERROR, the error, the fallback count and
the first fallback reasons. Not a test: it needs transformers (and torchvision for the vision models), which
the package does not depend on.

    python scripts/zoo_sweep.py [--device cuda] [--dtypes float32,bfloat16] [--train] [--only Bert,resnet]

Errors are max |ours - eager| over max |eager|; gradients compare each parameter's error against the largest
gradient of the model (a parameter whose exact gradient is zero, such as an attention key's bias, would make a
per-parameter ratio meaningless).
"""

from __future__ import annotations

import argparse
import time
import traceback

import torch

import stitchflow.backend as backend

VOCAB = 256
DECODER = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=256, vocab_size=VOCAB, max_position_embeddings=128)
ENCODER = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=VOCAB,
               max_position_embeddings=128)
HF = {  # architecture: config keywords (two layers, width 128)
    "LlamaForCausalLM": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=256, vocab_size=VOCAB, max_position_embeddings=128),
    "MistralForCausalLM": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=256, vocab_size=VOCAB, max_position_embeddings=128),
    "Qwen2ForCausalLM": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=256, vocab_size=VOCAB, max_position_embeddings=128),
    "GemmaForCausalLM": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                             head_dim=32, intermediate_size=256, vocab_size=VOCAB, max_position_embeddings=128),
    "PhiForCausalLM": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                           vocab_size=VOCAB, max_position_embeddings=128),
    "GPT2LMHeadModel": dict(n_embd=128, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=128),
    "GPTNeoXForCausalLM": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                               vocab_size=VOCAB, max_position_embeddings=128),
    "BloomForCausalLM": dict(hidden_size=128, n_layer=2, n_head=4, vocab_size=VOCAB),
    "FalconForCausalLM": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB),
    "OPTForCausalLM": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, ffn_dim=256,
                           vocab_size=VOCAB, max_position_embeddings=128, word_embed_proj_dim=128),
    "BertModel": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                      vocab_size=VOCAB, max_position_embeddings=128),
    "RobertaModel": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                         vocab_size=VOCAB, max_position_embeddings=130),
    "DistilBertModel": dict(dim=128, n_layers=2, n_heads=4, hidden_dim=256, vocab_size=VOCAB,
                            max_position_embeddings=128),
    "DebertaV2Model": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                           vocab_size=VOCAB, max_position_embeddings=128),
    "T5Model": dict(d_model=128, d_ff=256, num_layers=2, num_heads=4, d_kv=32, vocab_size=VOCAB),
    "BartModel": dict(d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256, vocab_size=VOCAB,
                      max_position_embeddings=128),
    "ViTModel": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                     image_size=64, patch_size=8),
    "SwinModel": dict(embed_dim=32, depths=[1, 1], num_heads=[2, 4], image_size=64, patch_size=4, window_size=4),
    "ConvNextModel": dict(hidden_sizes=[32, 64, 96, 128], depths=[1, 1, 1, 1]),
    "MambaModel": dict(hidden_size=64, num_hidden_layers=1, vocab_size=VOCAB, state_size=8, intermediate_size=128),
    "Qwen3ForCausalLM": dict(DECODER, head_dim=32),
    "Phi3ForCausalLM": dict(DECODER, pad_token_id=0),
    "Gemma2ForCausalLM": dict(DECODER, head_dim=32, sliding_window=16),
    "Gemma3ForCausalLM": dict(DECODER, head_dim=32, sliding_window=16),
    "Starcoder2ForCausalLM": dict(DECODER, sliding_window=16),
    "OlmoForCausalLM": dict(DECODER, pad_token_id=0),
    "GPTJForCausalLM": dict(n_embd=128, n_layer=2, n_head=4, rotary_dim=16, vocab_size=VOCAB, n_positions=128),
    "MixtralForCausalLM": dict(DECODER, num_local_experts=4, num_experts_per_tok=2),
    "Qwen3MoeForCausalLM": dict(DECODER, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                                decoder_sparse_step=1),
    "Mamba2Model": dict(hidden_size=64, num_hidden_layers=1, vocab_size=VOCAB, state_size=16, num_heads=4,
                        head_dim=32, expand=2, n_groups=1, chunk_size=16),
    "CLIPVisionModel": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                            image_size=64, patch_size=8),
    # session 51
    "LlamaForSequenceClassification": dict(DECODER, pad_token_id=0, num_labels=3),
    "Qwen2MoeForCausalLM": dict(DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                                shared_expert_intermediate_size=128, decoder_sparse_step=1),
    "GraniteForCausalLM": dict(DECODER),
    "CohereForCausalLM": dict(DECODER),
    "StableLmForCausalLM": dict(DECODER),
    "GPTBigCodeForCausalLM": dict(n_embd=128, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=128),
    "GPTNeoForCausalLM": dict(hidden_size=128, num_layers=2, num_heads=4, vocab_size=VOCAB, max_position_embeddings=128,
                              attention_types=[[["global", "local"], 1]], window_size=8),
    "ElectraModel": dict(ENCODER, embedding_size=64),
    "AlbertModel": dict(ENCODER, embedding_size=64),
    "XLMRobertaModel": dict(ENCODER, max_position_embeddings=130),
    "MPNetModel": dict(ENCODER, max_position_embeddings=130),
    "FNetModel": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256, vocab_size=VOCAB),
    "ModernBertModel": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                            vocab_size=VOCAB, pad_token_id=0),
    "OlmoeForCausalLM": dict(DECODER, num_experts=4, num_experts_per_tok=2),
    "Dinov2Model": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=64, patch_size=8),
    "SegformerModel": dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[32, 64],
                           num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2]),
    "BeitModel": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, image_size=64,
                      patch_size=8, use_relative_position_bias=True),
    "SiglipVisionModel": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                              image_size=64, patch_size=8),
    # a vision-language model: 16 image features per image written over its image tokens (masked_scatter)
    "LlavaForConditionalGeneration": dict(
        vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, image_size=32, patch_size=8),
        text_config=dict(DECODER, model_type="llama"), image_token_id=VOCAB - 1, vision_feature_layer=-1,
        vision_feature_select_strategy="default"),
}
PIXELS = ("ViT", "Swin", "ConvNext", "CLIPVision", "Dinov2", "Segformer", "Beit", "SiglipVision")  # take images
TORCHVISION = {"resnet18": {}, "mobilenet_v3_small": {}, "efficientnet_b0": {}, "convnext_tiny": {},
               "vit_b_16": dict(image_size=64), "swin_t": {}}
DROPOUTS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout", "resid_pdrop",
            "embd_pdrop", "attn_pdrop", "hidden_dropout", "activation_dropout", "dropout_rate", "classifier_dropout",
            "drop_path_rate")


def hf_model(name: str):
    import transformers

    cls = getattr(transformers, name)
    config = cls.config_class(**HF[name])
    for key in DROPOUTS:
        if hasattr(config, key):
            setattr(config, key, 0.0)
    return cls(config)


def hf_inputs(name: str, device, length: int = 32):
    g = torch.Generator().manual_seed(length)
    if name.startswith(PIXELS):
        return dict(pixel_values=torch.randn(2, 3, 64, 64, generator=g).to(device))
    if name.startswith("Llava"):  # 16 image tokens per sequence, one 32x32 image each
        ids = torch.randint(0, VOCAB - 1, (2, length), generator=g)
        ids[:, 3:19] = VOCAB - 1
        return dict(input_ids=ids.to(device), pixel_values=torch.randn(2, 3, 32, 32, generator=g).to(device))
    kw = dict(input_ids=torch.randint(0, VOCAB, (2, length), generator=g).to(device))
    if name.startswith(("T5", "Bart")):
        kw["decoder_input_ids"] = torch.randint(0, VOCAB, (2, length // 2), generator=g).to(device)
    return kw


def vision_model(name: str):
    import torchvision

    model = getattr(torchvision.models, name)(**TORCHVISION[name])
    for module in model.modules():  # random masks differ between two runs; the HF configs set these to 0 too
        if isinstance(module, (torch.nn.Dropout, torchvision.ops.StochasticDepth)):
            module.p = 0.0
    return model


def first(out):
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return out[0]


def step(fn, model, kwargs, train):
    if not train:
        with torch.no_grad():
            return first(fn(**kwargs)).float(), None
    model.zero_grad(set_to_none=True)
    out = first(fn(**kwargs))
    weights = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out).sin()
    (out.float() * weights).sum().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().float(), grads


def compare(name, model, inputs, train, tol, options, backend_name="stitchflow"):
    """The compiled model against eager on each set of keyword inputs in turn (inputs of new shapes make Dynamo
    compile again, for dynamic shapes from the second on); the worst errors and the first call's time."""
    model.train(train)
    compiled = torch.compile(model, backend=backend_name, options=options if backend_name == "stitchflow" else None)
    err = gerr = first_call = 0.0
    for k, kwargs in enumerate(inputs):
        want, want_grads = step(model, model, kwargs, train)
        t0 = time.perf_counter()
        step(compiled, model, kwargs, train)
        first_call = first_call or time.perf_counter() - t0
        got, grads = step(compiled, model, kwargs, train)
        err = max(err, ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item())
        if train:
            largest = max(g.abs().max().item() for g in want_grads.values())
            gerr = max(gerr, max((grads[n] - g).abs().max().item() for n, g in want_grads.items()) / max(largest, 1e-12))
    ok = err <= tol and gerr <= 10 * tol
    return ok, err, gerr, first_call


def _inputs(name: str, source: str, device, dtype, length: int) -> dict:
    """A model's keyword inputs at a sequence length (an image of side 3 x length for torchvision's CNNs, 96 at 32;
    models built for one image size take it whatever the length)."""
    if source == "hf":
        kwargs = hf_inputs(name, device, length)
    else:
        side = TORCHVISION[name].get("image_size", 3 * length)
        kwargs = dict(x=torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(1)).to(device))
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in kwargs.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--train", action="store_true", help="also a training step (float32), gradients compared")
    ap.add_argument("--only", default="", help="comma-separated substrings of model names")
    ap.add_argument("--target", default=None, help="options['target'] (default: gpu on CUDA, else reference)")
    ap.add_argument("--backend", default="stitchflow", help="another torch.compile backend, to tell its failures "
                    "from ours (e.g. inductor)")
    ap.add_argument("--traceback", action="store_true", help="print each error's whole traceback")
    ap.add_argument("--lengths", default="32", help="comma-separated sequence lengths (image sides: twice as many "
                    "pixels), run in turn through one compiled model: from the second on, Dynamo compiles again "
                    "with dynamic shapes")
    args = ap.parse_args(argv)
    # float32 is compared as float32: cuDNN's default TF32 convolutions, rounded differently in two runs of a
    # batch-normalised CNN's backward, differ by far more than the tolerance
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    only = [o for o in args.only.split(",") if o]
    runs = [(d, False) for d in args.dtypes.split(",") if d] + ([("float32", True)] if args.train else [])
    models = [(n, "hf") for n in HF] + [(n, "torchvision") for n in TORCHVISION]
    options = {"target": args.target} if args.target else {}
    summary = []
    for name, source in models:
        if only and not any(o.lower() in name.lower() for o in only):
            continue
        for dtype_name, train in runs:
            dtype = getattr(torch, dtype_name)
            torch.manual_seed(0)
            backend.FALLBACKS.clear()
            label = f"{name} {dtype_name}{' train' if train else ''}"
            try:
                model = (hf_model(name) if source == "hf" else vision_model(name)).to(args.device, dtype)
                inputs = [_inputs(name, source, args.device, dtype, int(n)) for n in args.lengths.split(",")]
                tol = 1e-3 if dtype == torch.float32 else 6e-2
                ok, err, gerr, first_call = compare(name, model, inputs, train, tol, options, args.backend)
                status = "ok" if ok else "MISMATCH"
                line = f"{status:8s} {label:40s} err {err:.1e} grad {gerr:.1e} first call {first_call:5.1f}s " \
                       f"fallbacks {len(backend.FALLBACKS)}"
            except Exception as err:  # noqa: BLE001 - a sweep reports and goes on
                status = "ERROR"
                line = f"ERROR    {label:40s} {type(err).__name__}: {str(err) if args.traceback else str(err)[:300]}"
                traceback.print_exc(limit=None if args.traceback else -3)
            print(line, flush=True)
            for reason in list(dict.fromkeys(backend.FALLBACKS))[:8]:
                print(f"           fallback: {reason[:180]}", flush=True)
            summary.append(status)
            torch._dynamo.reset()
    print(f"\n{summary.count('ok')}/{len(summary)} ok, {summary.count('MISMATCH')} mismatches, "
          f"{summary.count('ERROR')} errors", flush=True)


if __name__ == "__main__":
    main()
