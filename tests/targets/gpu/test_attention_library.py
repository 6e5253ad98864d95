"""torch's scaled_dot_product_attention as a candidate of the attention step: where it computes the same
thing (no key bias, the output in Q's dtype, a mask small enough to hand over), the autotuner times it
beside our tiles and keeps the faster (dense attention is faster there). Pinned here, it equals eager on
CPU tensors; on the GPU the timing decides."""

import math
import os

import pytest
import torch
import torch.nn.functional as F

import stitchflow
from conftest import assert_close
from stitchflow.targets.gpu.attention import LIBRARY, AttentionStep

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the gpu target runs on CPU tensors only under TRITON_INTERPRET=1")


def _step(prog) -> AttentionStep:
    (step,) = [s for c in prog.compiled for s in c.steps if isinstance(s, AttentionStep)]
    return step


def _sdpa(**kwargs):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs)


S = 48
MASKS = {
    "none": ({}, (False, None)),
    "causal": ({"is_causal": True}, (True, None)),
    "boolean": ({"attn_mask": torch.rand(S, S, generator=torch.Generator().manual_seed(0)) > 0.3}, (False, torch.bool)),
    "offsets": ({"attn_mask": torch.randn(S, S, generator=torch.Generator().manual_seed(1))}, (False, "q")),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(MASKS))
def test_the_library_form_and_its_result(name, dtype):
    kwargs, (causal, mask_dtype) = MASKS[name]
    # a float mask in Q's dtype, as the docs ask (CUDA's eager attention gives NaN for a float32 one beside bfloat16)
    kwargs = {k: (v.to(DEVICE, dtype if v.is_floating_point() else v.dtype) if isinstance(v, torch.Tensor) else v)
              for k, v in kwargs.items()}
    q, k, v = (torch.randn(2, 3, S, 16, device=DEVICE).to(dtype) for _ in range(3))
    fn = _sdpa(scale=0.2, **kwargs)
    prog = stitchflow.compile(fn, (q, k, v), target="gpu", options={"attention_tiles": tuple(vars(LIBRARY).values())})
    assert_close(prog(q, k, v), fn(q, k, v))
    step = _step(prog)
    found_causal, mask = step.library_form()
    assert found_causal == causal
    assert (mask is None) == (mask_dtype is None)
    if mask is not None:
        assert mask.dtype == (dtype if mask_dtype == "q" else mask_dtype)
    assert step.chosen == LIBRARY and "torch's scaled_dot_product_attention" in step.describe()


def test_a_key_bias_keeps_our_tiles_only():
    """A padding mask passed with the call (a key bias) is not handed to the library."""
    q = torch.randn(2, 2, 16, 8, device=DEVICE)
    pad = torch.zeros(2, 1, 1, 16, device=DEVICE)
    pad[:, :, :, -3:] = -math.inf

    def fn(q, pad):
        return torch.softmax(q @ q.transpose(-1, -2) * 0.3 + pad, -1) @ q

    prog = stitchflow.compile(fn, (q, pad), target="gpu", fusion="full")
    assert_close(prog(q, pad), fn(q, pad))
    step = _step(prog)
    assert step.library_form() is None
    assert LIBRARY not in list(step._candidates({step.match.q.tensor: q}))
