"""A boolean mask turned into torch's own attention bias once a call (library_mask.py): the bias gives torch's
attention the answer the mask gives it, fully masked queries included; the layers of a call share it."""

import os

import pytest
import torch
import torch.nn.functional as F

import stitchflow
import stitchflow.targets.gpu.attention as attention
from stitchflow.targets.gpu.attention import LIBRARY
from stitchflow.targets.gpu.library_mask import conversion_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def operands(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, 12, 16, generator=g).to(DEVICE, dtype) for _ in range(3)]


def a_mask(shape=(2, 1, 12, 12), seed=1):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.4
    mask[..., 3, :] = False  # a query with no key: each kernel has its own answer there
    return mask.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("broadcast", [False, True])
def test_the_bias_gives_the_masks_answer(dtype, broadcast):
    q, k, v = operands(dtype)
    mask = a_mask((12, 12)).expand(2, 1, 12, 12) if broadcast else a_mask()
    conversion = conversion_for(q, k, v, mask, scale=0.25)
    assert conversion is not None
    bias = conversion(mask)
    assert bias.dtype != torch.bool and bias.shape[-2:] == mask.shape[-2:]  # (memory-efficient's: over the heads)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.25)
    # bit for bit, NaN where the mask's answer is NaN (a kernel's answer for a query with no key)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_a_float_mask_has_nothing_to_convert():
    """Nothing but views of it (memory-efficient attention expands a bias over the heads; it pads one whose rows
    are not a multiple of 16 long, which would be a conversion worth hoisting too, so the keys here are 16)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 16, 16, generator=g).to(DEVICE) for _ in range(3))
    assert conversion_for(q, k, v, torch.zeros(2, 1, 16, 16, device=DEVICE)) is None


@pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the gpu target runs on CPU tensors only under TRITON_INTERPRET=1")
def test_two_layers_of_a_call_share_one_conversion(monkeypatch):
    """Two attentions read the same mask of the call: its bias is made once a call, and the program equals eager."""
    made = []

    def counting(*args, **kwargs):
        conversion = conversion_for(*args, **kwargs)
        return None if conversion is None else (lambda m: made.append(1) or conversion(m))

    monkeypatch.setattr(attention, "conversion_for", counting)
    g = torch.Generator().manual_seed(3)
    w1, w2 = (torch.randn(16, 16, generator=g).to(DEVICE) / 4 for _ in range(2))

    def two_layers(x, mask):
        h = x + F.scaled_dot_product_attention(x @ w1, x, x, attn_mask=mask)
        return h + F.scaled_dot_product_attention(h @ w2, h, h, attn_mask=mask)

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # as models run on the GPU (cuDNN's kernel)
    w1, w2 = w1.to(dtype), w2.to(dtype)
    x, mask = operands(dtype)[0], a_mask((2, 1, 12, 12), seed=5)
    prog = stitchflow.compile(two_layers, (x, mask), target="gpu", fusion="auto",
                              options={"attention_tiles": tuple(vars(LIBRARY).values()), "cuda_graphs": False})
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for call in range(2):
        torch.testing.assert_close(prog(x, mask), two_layers(x, mask), rtol=tol, atol=tol, equal_nan=True)
        assert len(made) == call + 1


@pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the gpu target runs on CPU tensors only under TRITON_INTERPRET=1")
def test_a_constant_mask_is_converted_once(monkeypatch):
    """A mask folded at compile time (here a band of keys) reaches torch's attention as its bias, made at the first
    call and kept for the next ones."""
    made = []

    def counting(*args, **kwargs):
        made.append(1)
        return conversion_for(*args, **kwargs)

    monkeypatch.setattr(attention, "conversion_for", counting)
    positions = torch.arange(12, device=DEVICE)
    band = (positions[:, None] - positions[None, :]).abs() <= 3  # a sliding window

    def banded(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=band)

    q, k, v = operands(torch.float32, seed=7)
    prog = stitchflow.compile(banded, (q, k, v), target="gpu", fusion="auto",
                              options={"attention_tiles": tuple(vars(LIBRARY).values()), "cuda_graphs": False})
    for _ in range(3):
        torch.testing.assert_close(prog(q, k, v), banded(q, k, v), rtol=1e-5, atol=1e-5)
    assert len(made) == 1
