"""Activations from NCHW to channels last in one launch (targets/gpu/planes.py), against torch's
conversion, under TRITON_INTERPRET=1 on CPU tensors (on a GPU session, on CUDA tensors)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from stitchflow.targets.gpu.planes import to_channels_last  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


@pytest.mark.parametrize("shape, dtype", [((2, 64, 16, 16), torch.bfloat16), ((3, 130, 9, 11), torch.float32),
                                          ((2, 5, 33, 35), torch.float16), ((1, 1, 7, 3), torch.float32),
                                          ((2, 8, 4, 20, 20), torch.float32)])
def test_an_activation_goes_channels_last(shape, dtype):
    """Tiles ragged at both edges (130 channels, 99 positions), one channel, 3-d windows."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(DEVICE, dtype)
    form = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    last = to_channels_last(x)
    assert last.is_contiguous(memory_format=form) and last.dtype == dtype and torch.equal(last, x)
    assert torch.equal(last.contiguous().view(-1), x.view(-1))  # every element where torch puts it


@pytest.mark.parametrize("case", ["already channels last", "3 dims", "strided"])
def test_what_it_does_not_copy(case):
    x = torch.randn(2, 6, 5, 4, device=DEVICE)
    given = {"already channels last": x.contiguous(memory_format=torch.channels_last), "3 dims": x[0],
             "strided": x.transpose(2, 3)}[case]
    out = to_channels_last(given)
    assert torch.equal(out, given)
    if case == "strided":  # through torch
        assert out.is_contiguous(memory_format=torch.channels_last)
    else:
        assert out is given


def test_like_gradient_copies_an_activation_behind_a_channels_last_gradient():
    from stitchflow.backend_layouts import like_gradient

    x = torch.randn(2, 16, 9, 9, device=DEVICE, dtype=torch.bfloat16)
    grad = torch.randn_like(x).contiguous(memory_format=torch.channels_last)
    moved = like_gradient(x, grad)
    assert moved.is_contiguous(memory_format=torch.channels_last) and torch.equal(moved, x)
    assert like_gradient(x, grad.contiguous()) is x and like_gradient(moved, grad) is moved
