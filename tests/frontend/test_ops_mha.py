"""nn.MultiheadAttention and nn.TransformerEncoderLayer in inference (frontend/ops_mha.py): Dynamo keeps
F.multi_head_attention_forward and the encoder layer's fast path as single calls, which lower to the ops they
stand for. Through torch.compile(backend="stitchflow"), equal to eager with nothing left eager: masks of both kinds
(boolean: True leaves a key out; float: added), the weights averaged or per head, separate key and value widths,
unbatched inputs, pre- and post-norm layers, a stack of them; and on the gpu target's kernels."""

import pytest
import torch
from torch import nn

from stitchflow import backend
from conftest import assert_close, skip_unless_kernels_run

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
E, HEADS, LENGTH = 32, 4, 7


def _padding():
    pad = torch.zeros(2, LENGTH, dtype=torch.bool)
    pad[1, 5:] = True
    return pad


CAUSAL = nn.Transformer.generate_square_subsequent_mask(LENGTH)


def _attention_cases():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, batch_first=True).eval()
    widths = nn.MultiheadAttention(E, HEADS, kdim=16, vdim=24).eval()  # sequence first, separate projections
    keys, values = torch.randn(9, 2, 16), torch.randn(9, 2, 24)
    return {
        "self": lambda x: mha(x, x, x)[0],
        "weights_averaged_and_per_head": lambda x: torch.cat(
            [mha(x, x * 2, x)[1], mha(x, x, x, average_attn_weights=False)[1].sum(1)], -1),
        "key_padding": lambda x: mha(x, x, x, key_padding_mask=_padding(), need_weights=False)[0],
        "float_causal_mask": lambda x: mha(x, x, x, attn_mask=CAUSAL, need_weights=False)[0],
        "boolean_masks_weights": lambda x: mha(x, x, x, attn_mask=CAUSAL.isinf(), key_padding_mask=_padding())[1],
        "separate_widths": lambda x: widths(x.transpose(0, 1)[:5], keys, values)[0],
        "unbatched": lambda x: mha(x[0], x[1], x[1])[0],
    }


def _encoder_cases():
    torch.manual_seed(0)

    def layer(**kw):
        return nn.TransformerEncoderLayer(E, HEADS, 64, batch_first=True, dropout=0.0, **kw).eval()

    post, pre, gelu = layer(), layer(norm_first=True), layer(activation="gelu")
    stack = nn.TransformerEncoder(layer(), 2, enable_nested_tensor=False).eval()
    return {
        "post_norm": lambda x: post(x),
        "pre_norm_key_padding": lambda x: pre(x, src_key_padding_mask=_padding()),
        "gelu_causal": lambda x: gelu(x, src_mask=CAUSAL),
        "both_masks": lambda x: post(x, src_mask=CAUSAL, src_key_padding_mask=_padding()),
        "stack": lambda x: stack(x),
    }


CASES = {**_attention_cases(), **_encoder_cases()}


def _check(fn, x, options=None):
    with torch.no_grad():
        got, want = torch.compile(fn, backend="stitchflow", options=options or {})(x), fn(x)
    assert_close(got, want)
    assert not backend.FALLBACKS, backend.fallback_report()


@pytest.mark.parametrize("name", sorted(CASES))
def test_attention_modules_compile_whole_in_inference(name):
    _check(CASES[name], torch.randn(2, LENGTH, E))


@pytest.mark.parametrize("name", ["weights_averaged_and_per_head", "both_masks"])
def test_attention_modules_on_the_gpu_targets_kernels(name):
    skip_unless_kernels_run("gpu")
    _check(CASES[name], torch.randn(2, LENGTH, E), {"target": "gpu"})


def test_what_is_not_lowered_runs_eagerly_with_the_reason():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, add_bias_kv=True, batch_first=True).eval()
    x = torch.randn(2, LENGTH, E)
    with torch.no_grad():
        assert_close(torch.compile(lambda x: mha(x, x, x)[0], backend="stitchflow")(x), mha(x, x, x)[0])
    assert "bias_k, bias_v or add_zero_attn" in backend.fallback_report()
