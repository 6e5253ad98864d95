"""Memory-intensive patterns (FusionStitching / AStitch): small modules plus input makers.

Each pattern has a module, a `make(shape, dtype, device, gen)` that draws fresh random inputs,
a large shape for the benchmark and small odd shapes for the CPU tests. Modules use only ops
the frontend lowers (no .std, no .gather: the cross-entropy pattern picks the target logit
with a one-hot select, as a fused kernel would).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


def _randn(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen, device="cpu", dtype=torch.float32).to(device=device, dtype=dtype)


class AddLayerNormGelu(nn.Module):
    def forward(self, x, r, w, b):
        return F.gelu(F.layer_norm(x + r, (x.shape[-1],), w, b))


class ScaleMaskSoftmax(nn.Module):
    def forward(self, s, mask):
        return torch.softmax(s * 0.125 + mask, dim=-1)


class RmsNormResidual(nn.Module):
    def forward(self, x, r, w):
        h = x + r
        return F.rms_norm(h, (h.shape[-1],), w, 1e-6), h


class BiasGelu(nn.Module):
    def forward(self, x, b):
        return F.gelu(x + b)


class BiasSiluGate(nn.Module):
    def forward(self, x, b, g):
        return F.silu(x + b) * g


class CrossEntropyLike(nn.Module):
    """Per-row loss: logsumexp - logit[target], as log_softmax + a one-hot select-sum."""

    def forward(self, logits, target):
        lp = torch.log_softmax(logits.float(), dim=-1)
        iota = torch.arange(logits.shape[-1], device=logits.device)
        picked = torch.where(iota == target[:, None], lp, 0.0).sum(-1)
        return -picked


class ColumnStandardize(nn.Module):
    def forward(self, x):
        mean = x.mean(0)
        xc = x - mean
        var = (xc * xc).mean(0)
        return xc * torch.rsqrt(var + 1e-5)


class ColumnCenter(nn.Module):
    def forward(self, x):
        return x - x.mean(0)


class GroupNormSilu(nn.Module):
    """Group norm (32 groups) then SiLU, as in a diffusion UNet's resnet blocks."""

    def forward(self, x, w, b):
        return F.silu(F.group_norm(x, 32, w, b))


class BatchNormTrain(nn.Module):
    """Batch-norm statistics as training computes them: two passes (mean, then centred var)."""

    def forward(self, x, w, b):
        mean = x.mean((0, 2, 3), keepdim=True)
        xc = x - mean
        var = (xc * xc).mean((0, 2, 3), keepdim=True)
        return xc * torch.rsqrt(var + 1e-5) * w[:, None, None] + b[:, None, None]


class RowSoftmax(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)


class LayerNorm(nn.Module):
    def forward(self, x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b)


class L2Normalize(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt((x.float() * x.float()).sum(-1, keepdim=True) + 1e-12).to(x.dtype)


class GeGluTanh(nn.Module):
    def forward(self, a, b):
        return F.gelu(a, approximate="tanh") * b


class IndependentOps(nn.Module):
    """Two unrelated ops in one region: packed into one launch when they are small."""

    def forward(self, x, b, y):
        return F.gelu(x + b), torch.softmax(y, dim=-1)


class TransposeBiasGelu(nn.Module):
    def forward(self, x, b):
        return F.gelu(x.t() + b)


class CausalMaskedSoftmax(nn.Module):
    def forward(self, s, keep):
        return torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)


@dataclass(frozen=True)
class Pattern:
    name: str
    module: Callable[[], nn.Module]
    make: Callable  # (shape, dtype, device, gen) -> tuple of inputs
    large: tuple
    dtype: torch.dtype
    small: tuple = ()  # small odd shapes for CPU tests
    note: str = ""


def _rows(n_extra_vecs=0, extra_same=0):
    """Inputs: x[R, C], `extra_same` more [R, C] tensors, `n_extra_vecs` vectors [C]."""

    def make(shape, dtype, device, gen):
        x = _randn(shape, dtype, device, gen)
        same = [_randn(shape, dtype, device, gen) for _ in range(extra_same)]
        vecs = [_randn(shape[-1:], dtype, device, gen) for _ in range(n_extra_vecs)]
        return (x, *same, *vecs)

    return make


def _add_ln_gelu(shape, dtype, device, gen):
    x, r = _randn(shape, dtype, device, gen), _randn(shape, dtype, device, gen)
    return x, r, 1 + 0.1 * _randn(shape[-1:], dtype, device, gen), 0.1 * _randn(shape[-1:], dtype, device, gen)


def _bias_silu_gate(shape, dtype, device, gen):
    return _randn(shape, dtype, device, gen), _randn(shape[-1:], dtype, device, gen), _randn(shape, dtype, device, gen)


def _scale_mask(shape, dtype, device, gen):
    s = 4 * _randn(shape, dtype, device, gen)
    mask = torch.where(torch.rand(shape[-2:], generator=gen) < 0.1, -10000.0, 0.0).to(device=device, dtype=dtype)
    return s, mask


def _cross_entropy(shape, dtype, device, gen):
    logits = 3 * _randn(shape, dtype, device, gen)
    target = torch.randint(0, shape[-1], shape[:1], generator=gen).to(device)
    return logits, target


def _batchnorm(shape, dtype, device, gen):
    x = 2 + _randn(shape, dtype, device, gen)
    return x, 1 + 0.1 * _randn(shape[1:2], dtype, device, gen), 0.1 * _randn(shape[1:2], dtype, device, gen)


def _column(shape, dtype, device, gen):
    return (3 + 2 * _randn(shape, dtype, device, gen),)


def _packed(shape, dtype, device, gen):
    return _randn(shape, dtype, device, gen), _randn(shape[-1:], dtype, device, gen), _randn(shape, dtype, device, gen)


def _transpose(shape, dtype, device, gen):
    return _randn(shape[::-1], dtype, device, gen), _randn(shape[-1:], dtype, device, gen)


def _causal(shape, dtype, device, gen):
    s = _randn(shape, dtype, device, gen)
    keep = torch.ones(shape[-2:], dtype=torch.bool).tril().to(device)
    return s, keep


def _one(shape, dtype, device, gen):
    return (_randn(shape, dtype, device, gen),)


PATTERNS: dict[str, Pattern] = {p.name: p for p in [
    Pattern("add_layernorm_gelu", AddLayerNormGelu, _add_ln_gelu, (16384, 4096), torch.bfloat16, ((7, 33), (5, 130))),
    Pattern("scale_mask_softmax", ScaleMaskSoftmax, _scale_mask, (256, 1024, 1024), torch.bfloat16, ((3, 5, 33),)),
    Pattern("rmsnorm_residual", RmsNormResidual, _rows(1, 1), (16384, 4096), torch.bfloat16, ((7, 33), (5, 130))),
    Pattern("bias_gelu", BiasGelu, _rows(1), (16384, 4096), torch.bfloat16, ((7, 33),)),
    Pattern("bias_silu_gate", BiasSiluGate, _bias_silu_gate, (16384, 4096), torch.bfloat16, ((7, 33),)),
    Pattern("cross_entropy_like", CrossEntropyLike, _cross_entropy, (8192, 32000), torch.bfloat16, ((7, 33), (5, 130))),
    Pattern("column_standardize", ColumnStandardize, _column, (65536, 1024), torch.float32, ((33, 7), (130, 5))),
    Pattern("column_center", ColumnCenter, _column, (65536, 1024), torch.float32, ((33, 7),)),
    Pattern("batchnorm_train", BatchNormTrain, _batchnorm, (64, 256, 56, 56), torch.float32, ((3, 5, 7, 9),)),
    Pattern("softmax_750000x32", RowSoftmax, _one, (750000, 32), torch.float32, ((33, 5),)),
    Pattern("softmax_64x30000", RowSoftmax, _one, (64, 30000), torch.float32, ((3, 1000),)),
    Pattern("softmax_long_rows", RowSoftmax, _one, (2048, 65536), torch.float32, ((3, 700),)),
    Pattern("layernorm_fp32", LayerNorm, _rows(2), (16384, 4096), torch.float32, ((7, 33),)),
    Pattern("l2_normalize", L2Normalize, _one, (16384, 4096), torch.bfloat16, ((7, 33),)),
    Pattern("geglu_tanh", GeGluTanh, _rows(0, 1), (16384, 4096), torch.bfloat16, ((7, 33),)),
    Pattern("independent_gelu_softmax", IndependentOps, _packed, (16384, 2048), torch.bfloat16, ((7, 33),),
            note="packed into one launch when small; large parts get kernels of their own"),
    Pattern("transpose_bias_gelu", TransposeBiasGelu, _transpose, (8192, 4096), torch.bfloat16, ((7, 33),)),
    Pattern("causal_masked_softmax", CausalMaskedSoftmax, _causal, (64, 2048, 2048), torch.bfloat16, ((2, 9, 9),)),
    Pattern("groupnorm_silu", GroupNormSilu, _batchnorm, (16, 512, 64, 64), torch.bfloat16, ((2, 64, 5, 7),)),
]}


def min_bytes(inputs, outputs) -> int:
    """Each input read once and each output written once: the traffic floor."""
    flat = [t for t in (*inputs, *outputs) if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in flat)


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def relative_error(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return (torch.linalg.vector_norm(out - ref) / max(torch.linalg.vector_norm(ref).item(), 1e-30)).item()


def tolerance(dtype: torch.dtype) -> float:
    return 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4


def count_elements(shape) -> int:
    return math.prod(shape)


def pattern_kernel(name: str, shape, dtype: torch.dtype = torch.float32, strides: dict | None = None):
    """(group kernel, input strides) of pattern `name`, compiled for `shape` on CPU tensors: the
    one generated kernel of the pattern under full fusion, from which tests build the kernel of
    any config (`codegen.build_kernel(k.graph, [(k.plans[0], cfg)], strides, ...)`)."""
    from .. import compile as compile_program
    from ..targets.gpu.emit import contiguous_strides

    args = PATTERNS[name].make(tuple(shape), dtype, "cpu", torch.Generator().manual_seed(0))
    prog = compile_program(PATTERNS[name].module(), args, target="gpu", fusion="full")
    (k,) = [k for run in prog._compiled for k in run.kernels]
    return k, strides or {t: contiguous_strides(k.graph.type_of[t].shape) for t in k.inputs}
