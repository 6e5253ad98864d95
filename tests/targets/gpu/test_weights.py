"""Convolution weights stored channels last in one launch (targets/gpu/weights.py), against torch's
conversion, under TRITON_INTERPRET=1 on CPU tensors (on a GPU session, on CUDA tensors)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from stitchflow.targets.gpu.weights import TILE, channels_last_copies, contiguous_copies  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _weights():
    g = torch.Generator().manual_seed(0)
    shapes = [((64, 3, 7, 7), torch.bfloat16), ((8, 8, 1, 1), torch.bfloat16), ((5, 1, 3, 3), torch.float32),
              ((3, 4, 2, 3, 5), torch.float32), ((7, 33, 3, 3), torch.bfloat16), ((2, 2 * TILE + 3, 1, 1), torch.float32),
              ((3, TILE // 8 + 3, 3, 3), torch.float32)]  # channels over three tiles
    return [torch.randn(s, generator=g).to(DEVICE, dtype) for s, dtype in shapes]


def test_every_weight_is_copied_channels_last_in_one_launch():
    weights = _weights()
    copies = channels_last_copies(weights)
    for w, c in zip(weights, copies):
        form = torch.channels_last if w.dim() == 4 else torch.channels_last_3d
        assert c.is_contiguous(memory_format=form) and c.dtype == w.dtype and torch.equal(c, w)
        assert (c is w) == w.is_contiguous(memory_format=form)  # a 1x1 weight is both: kept


def test_channels_last_tensors_are_copied_back_contiguous_in_one_launch():
    """Weight gradients cuDNN returns channels last, and an image's gradient, copied into the parameters'
    NCHW layout in one launch; those already contiguous (a 1x1 weight is both), of another rank, or in
    neither layout are left as they are."""
    lasts = [w.contiguous(memory_format=torch.channels_last if w.dim() == 4 else torch.channels_last_3d)
             for w in _weights()] + [torch.randn(2, 3, *hw, device=DEVICE).contiguous(memory_format=torch.channels_last)
                                     for hw in ((9, 7), (40, 40))]  # the second's planes exceed a tile: torch's copy
    others = [torch.randn(4, 3, 3, 3, device=DEVICE), torch.randn(5, 6, device=DEVICE),
              torch.randn(4, 3, 3, 3, device=DEVICE).transpose(2, 3)]
    copies = contiguous_copies(lasts + others)
    for t, c in zip(lasts, copies):
        assert c.is_contiguous() and c.dtype == t.dtype and torch.equal(c, t)
    for t, c in zip(others, copies[len(lasts):]):
        assert c is t


@pytest.mark.parametrize("case", ["already channels last", "not contiguous", "3 dims", "empty"])
def test_weights_the_kernel_does_not_take(case):
    w = torch.randn(6, 4, 3, 3, device=DEVICE)
    other = {"already channels last": w.contiguous(memory_format=torch.channels_last),
             "not contiguous": w.transpose(2, 3), "3 dims": w[0], "empty": w[:0]}[case]
    out = channels_last_copies([w, other])
    assert torch.equal(out[0], w) and out[0].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out[1], other)
    if case in ("already channels last", "3 dims"):
        assert out[1] is other
    elif case == "not contiguous":
        assert out[1].is_contiguous(memory_format=torch.channels_last)


def test_the_kernel_compiles_for_hopper(fresh_python):
    """The interpreter takes any Python: the per-weight tile shapes (constexpr tuples indexed in a static
    loop), both ways, must also compile for sm_90 (in a fresh process without the interpreter, conftest.run_fresh),
    their turn through shared memory included."""
    code = ("import json, sys\nfrom stitchflow.targets.gpu.weights import compile_for_sm90\n"
            "shapes = json.loads(sys.stdin.read())\n"
            "print(json.dumps([compile_for_sm90(shapes, to_last) for to_last in (True, False)]))\n")
    for made in fresh_python(code, [[8, 64, 3, 3], [64, 3, 7, 7], [4, 300, 3, 3]]):
        assert made["tiles"] == [[64, 16], [4, 64], [64, 16]]
        assert made["turned_in_shared"] and made["shared"] > 0
