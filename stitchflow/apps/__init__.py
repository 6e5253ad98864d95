"""The app zoo: the models stitchflow is measured on, with seeded weights and example inputs.

``APPS[name].build(size=..., dataset=..., block=..., seed=...)`` returns ``(model.eval(),
example_inputs)`` ready for eager runs, ``torch.fx.symbolic_trace`` and the compiler. Sizes:
"small" is for CPU tests and the Triton interpreter; "default" is the paper's workload size
(FuseFlow's GCN on Cora, GPT-3-small with BigBird, ...); some apps have named sizes too
(``AppSpec.sizes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .bigbird import BlockMask, bigbird_block_mask, expected_density
from .gnn import GCN, GCNLayer, GraphSAGE, SAGELayer
from .gpt3 import GPT3, GPT3_PRESETS, BlockSparseAttention, GPT3Decoder, OutputAndFFN, QKVProjection
from .hf import HF_MODELS, HFCall, build_hf
from .graphs import DATASETS, GraphData, load_dataset, load_planetoid, synthetic_powerlaw
from .resnet import RESNET_PRESETS, ResNet
from .unet import UNET_PRESETS, UNet
from .sae import SAE_BATCH, SAE_PRESETS, SAE_SMALL, SparseAutoencoder, SparseLinear, sae_inputs
from .transformer import (BERT_PRESETS, LLAMA_PRESETS, BertBlock, LlamaBlock, RMSNorm,
                          RotaryEmbedding, bert_preset, llama_preset, rotate_half)

Built = tuple[nn.Module, tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class AppSpec:
    """A named workload: ``build(size, dataset, block, seed, dtype) -> (model.eval(), inputs)``."""

    name: str
    description: str
    build: Callable[..., Built]
    sizes: tuple[str, ...]


def _inputs_gen(seed: int) -> torch.Generator:
    # Offset from the weight seed so inputs and weights are not the same random stream.
    return torch.Generator().manual_seed(int(seed) + 7919)


def _check_size(size: str, sizes: tuple[str, ...], app: str) -> None:
    if size not in sizes:
        raise ValueError(f"{app}: unknown size {size!r}; known: {', '.join(sizes)}")


def _build_gnn(cls: type[nn.Module], app: str) -> Callable[..., Built]:
    """GNN builder: size "small" → the "tiny" graph, "default" → Cora; ``dataset`` overrides."""

    def build(size: str = "small", dataset: str | None = None, block: int | None = None,
              seed: int = 0, dtype: torch.dtype = torch.float32) -> Built:
        _check_size(size, ("small", "default"), app)
        data = load_dataset(dataset or ("tiny" if size == "small" else "cora"), seed=seed)
        classes = int(data.y.max()) + 1 if data.y is not None else 8
        model = cls(data.num_features, 16, classes, seed=seed, dtype=dtype)
        return model.eval(), (data.adjacency("csr", dtype=dtype), data.x.to(dtype))

    return build


def _build_sae(size: str = "small", dataset: str | None = None, block: int | None = None,
               seed: int = 0, dtype: torch.dtype = torch.float32) -> Built:
    """SAE builder: "small" is 256 → 32 at batch 8; "default" or a preset name at batch 32."""
    _check_size(size, ("small", "default", *SAE_PRESETS), "sae")
    if size == "small" and dataset is None:
        in_features, hidden = SAE_SMALL
        batch = 8
    else:
        in_features, hidden = SAE_PRESETS[dataset or (size if size in SAE_PRESETS else "imagenet")]
        batch = SAE_BATCH
    model = SparseAutoencoder(in_features, hidden, seed=seed, dtype=dtype)
    return model.eval(), (sae_inputs(in_features, batch, seed, dtype),)


def _build_gpt3(size: str = "small", dataset: str | None = None, block: int | None = None,
                seed: int = 0, dtype: torch.dtype = torch.float32) -> Built:
    """GPT-3 builder: "small" (2 tiny decoders), "decoder" (one full-size decoder) or
    "default" (FuseFlow's 12-decoder GPT-3-small); ``block`` picks 16, 32 or 64."""
    _check_size(size, ("small", "decoder", "default"), "gpt3-bigbird")
    cfg = dict(GPT3_PRESETS["small" if size == "small" else "gpt3-small"])
    if block is not None:
        cfg["block"] = block
    if size == "decoder":
        cfg.pop("num_layers")
        model: nn.Module = GPT3Decoder(seed=seed, dtype=dtype, **cfg)
    else:
        model = GPT3(seed=seed, dtype=dtype, **cfg)
    x = torch.randn(cfg["seq"], cfg["width"], generator=_inputs_gen(seed)).to(dtype)
    return model.eval(), (x,)


def padding_mask(batch: int, seq: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An additive (B, 1, 1, S) key-padding mask: the last quarter of the keys of every odd
    batch element is padding (-inf), so masked and unmasked rows both occur."""
    mask = torch.zeros(batch, 1, 1, seq, dtype=dtype)
    mask[1::2, ..., seq - seq // 4:] = float("-inf")
    return mask


def _build_block(presets: dict[str, dict[str, int]], factory: Callable[..., nn.Module],
                 default: str, app: str, masked: bool = False) -> Callable[..., Built]:
    """Dense-block builder: batch 2 at "small", batch 1 at "default" or a named preset.
    ``masked`` builds the block with an additive attention mask and passes one as input 2."""

    def build(size: str = "small", dataset: str | None = None, block: int | None = None,
              seed: int = 0, dtype: torch.dtype = torch.float32) -> Built:
        _check_size(size, ("default", *presets), app)
        name = default if size == "default" else size
        model = factory(name, seed=seed, dtype=dtype, **({"use_mask": True} if masked else {}))
        batch = 2 if name == "small" else 1
        cfg = presets[name]
        x = torch.randn(batch, cfg["seq"], cfg["width"], generator=_inputs_gen(seed)).to(dtype)
        extra = (padding_mask(batch, cfg["seq"], dtype),) if masked else ()
        return model.eval(), (x, *extra)

    return build


def _build_resnet(size: str = "small", dataset: str | None = None, block: int | None = None,
                  seed: int = 0, dtype: torch.dtype = torch.float32) -> Built:
    """ResNet builder: "small" (two tiny stages on 32x32 images), "default" = resnet18 or a preset,
    batch 2 at "small" and 32 otherwise."""
    _check_size(size, ("small", "default", *RESNET_PRESETS), "resnet")
    cfg = RESNET_PRESETS["resnet18" if size == "default" else size]
    model = ResNet(seed=seed, dtype=dtype, **cfg)
    x = torch.randn(cfg["batch"], 3, cfg["image"], cfg["image"], generator=_inputs_gen(seed)).to(dtype)
    return model.eval(), (x,)


def _build_unet(size: str = "small", dataset: str | None = None, block: int | None = None,
                seed: int = 0, dtype: torch.dtype = torch.float32) -> Built:
    """U-Net builder: "small" (two levels on 16x16), "default" = "sd-like" (three levels, 64 to 256
    channels, batch 8 of 64x64 images)."""
    _check_size(size, ("small", "default", *UNET_PRESETS), "unet")
    cfg = UNET_PRESETS["sd-like" if size == "default" else size]
    model = UNet(seed=seed, dtype=dtype, **cfg)
    x = torch.randn(cfg["batch"], 3, cfg["image"], cfg["image"], generator=_inputs_gen(seed)).to(dtype)
    return model.eval(), (x,)


APPS: dict[str, AppSpec] = {spec.name: spec for spec in (
    AppSpec("gcn", "FuseFlow GCN: softmax(A·relu(A·X·W1+b1)·W2+b2), 50%-sparse weights",
            _build_gnn(GCN, "gcn"), ("small", "default")),
    AppSpec("graphsage", "FuseFlow GraphSAGE: relu(X·Wself + (A·X)·Wneigh + b) per layer",
            _build_gnn(GraphSAGE, "graphsage"), ("small", "default")),
    AppSpec("sae", "FuseFlow sparse autoencoder: relu(X·Wenc+benc)·Wdec+bdec, 90%-sparse weights",
            _build_sae, ("small", "default", *SAE_PRESETS)),
    AppSpec("gpt3-bigbird", "GPT-3-small decoders with BigBird block-sparse attention",
            _build_gpt3, ("small", "decoder", "default")),
    AppSpec("bert", "BERT post-LN encoder block: softmax attention with an additive padding "
            "mask (input 2), GELU FFN", _build_block(BERT_PRESETS, bert_preset, "bert-base",
                                                     "bert", masked=True),
            ("small", "default", *[k for k in BERT_PRESETS if k != "small"])),
    AppSpec("llama", "Llama decoder block: RMSNorm, rotary, GQA causal attention, SwiGLU",
            _build_block(LLAMA_PRESETS, llama_preset, "llama3-8b", "llama"),
            ("small", "default", *[k for k in LLAMA_PRESETS if k != "small"])),
    AppSpec("resnet", "ResNet in inference mode: convolutions (cuDNN on the gpu target) with batch norm, "
            "relu, residual adds and pools stitched between them", _build_resnet,
            ("small", "default", *[k for k in RESNET_PRESETS if k != "small"])),
    AppSpec("unet", "diffusion-style U-Net without attention: group norm, SiLU, residual adds, nearest "
            "upsampling and skip concatenations between convolutions", _build_unet,
            ("small", "default", *[k for k in UNET_PRESETS if k != "small"])),
)}


def default_size(app: str, size: str | None = None, dataset: str | None = None) -> str:
    """The size the command line's verbs build when none is given: GNNs on Cora at the paper's
    size, every other app at "small"."""
    return size or ("default" if app in ("gcn", "graphsage") and dataset in (None, "cora") else "small")


def build_model(name: str, size: str = "small", seed: int = 0, dtype: torch.dtype = torch.float32) -> Built:
    """Any model the benchmarks take: an app of the zoo (APPS), or a Hugging Face model (HF_MODELS: whole models
    written by others, which torch.fx's symbolic tracing does not take, so they are not apps of the zoo)."""
    if name in HF_MODELS:
        return build_hf(name, size, seed, dtype)
    if name not in APPS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(APPS) + sorted(HF_MODELS))}")
    return APPS[name].build(size=size, seed=seed, dtype=dtype)

__all__ = [
    "APPS", "AppSpec", "DATASETS", "GraphData", "load_dataset", "load_planetoid",
    "synthetic_powerlaw", "BlockMask", "bigbird_block_mask", "expected_density",
    "GCN", "GCNLayer", "GraphSAGE", "SAGELayer", "SparseAutoencoder", "SparseLinear",
    "SAE_PRESETS", "SAE_BATCH", "SAE_SMALL", "sae_inputs", "GPT3", "GPT3Decoder",
    "GPT3_PRESETS", "QKVProjection", "BlockSparseAttention", "OutputAndFFN", "BertBlock",
    "LlamaBlock", "RMSNorm", "RotaryEmbedding", "rotate_half", "BERT_PRESETS",
    "LLAMA_PRESETS", "bert_preset", "llama_preset", "RESNET_PRESETS", "ResNet", "UNET_PRESETS", "UNet",
    "HF_MODELS", "HFCall", "build_hf", "build_model", "default_size",
]
