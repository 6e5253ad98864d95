"""Padding and convolution: captured and interpreted, equal to eager on random shapes, strides,
paddings, dilations and groups (hypothesis), in float32 and bfloat16."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import stitchflow
from conftest import assert_close, eager_gives_nothing

MODES = ["constant", "reflect", "replicate", "circular"]


def check(fn, *inputs, target="reference", **kwargs):
    prog = stitchflow.compile(fn, inputs, target=target, **kwargs)
    expected, actual = fn(*inputs), prog(*inputs)
    assert actual.shape == expected.shape
    assert_close(actual, expected)
    assert prog.regions_executed == len(prog.regions)
    return prog


@settings(max_examples=25, deadline=None)
@given(h=st.integers(2, 7), w=st.integers(2, 7), mode=st.sampled_from(MODES),
       pads=st.lists(st.integers(-1, 2), min_size=2, max_size=4), value=st.floats(-2, 2))
def test_pad_in_every_mode(h, w, mode, pads, value):
    pads = pads[:2] if len(pads) < 4 else pads
    x = torch.randn(2, 3, h, w)
    if mode != "constant" and len(pads) == 4:  # reflect and replicate need a batch dim before the padded ones
        x = x[0]
    kwargs = {"value": value} if mode == "constant" else {}
    empty = eager_gives_nothing(lambda x: F.pad(x, pads, mode=mode, **kwargs), x)  # e.g. too wide for reflect
    sizes = list(x.shape[::-1])
    if mode == "circular":  # wrapping around more than what cropping leaves: torch reads its own output, we refuse
        empty |= any(max(lo, hi) > n + min(lo, 0) + min(hi, 0) for n, lo, hi in zip(sizes, pads[::2], pads[1::2]))
    if empty:  # refused as torch refuses, or an empty result (unsupported by design)
        with pytest.raises(stitchflow.StitchflowError):
            stitchflow.compile(lambda x: F.pad(x, pads, mode=mode, **kwargs), (x,))
        return
    check(lambda x: F.pad(x, pads, mode=mode, **kwargs) * 2 + 1, x)


def test_pad_spellings_of_the_aten_graph():
    x = torch.randn(2, 3, 5, 4)
    check(lambda x: torch.constant_pad_nd(x, (1, 0, 2, 1), 0.5), x)
    check(lambda x: torch.ops.aten.reflection_pad2d(x, [1, 1, 2, 0]), x)
    check(lambda x: torch.ops.aten.replication_pad1d(x[0], [0, 3]), x)


def test_pad_refusals_name_the_problem():
    x = torch.randn(1, 2, 3)
    with pytest.raises(stitchflow.StitchflowError, match="pad.*fails in eager"):
        stitchflow.compile(lambda x: F.pad(x, (1, 1), mode="bogus"), (x,))
    with pytest.raises(stitchflow.StitchflowError, match="pad"):
        stitchflow.compile(lambda x: F.pad(x, (3, 3), mode="reflect"), (x,))


@settings(max_examples=30, deadline=None)
@given(n=st.sampled_from([1, 2, 3]), size=st.integers(3, 8), cin=st.integers(1, 3), cout=st.integers(1, 3),
       groups=st.sampled_from([1, 2]), k=st.integers(1, 3), stride=st.integers(1, 2), dilation=st.integers(1, 2),
       padding=st.sampled_from([0, 1, 2, "same", "valid"]), bias=st.booleans(), batched=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_convolutions(n, size, cin, cout, groups, k, stride, dilation, padding, bias, batched, dtype):
    if padding == "same":
        stride = 1
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[n]
    x = torch.randn(*([2] if batched else []), cin * groups, *[size - d for d in range(n)], dtype=dtype)
    w = torch.randn(cout * groups, cin, *[k] * n, dtype=dtype) / (cin * k ** n) ** 0.5
    b = torch.randn(cout * groups, dtype=dtype) if bias else None
    fn = lambda x, w: conv(x, w, b, stride, padding, dilation, groups).relu()  # noqa: E731
    if eager_gives_nothing(fn, x, w):  # the kernel is larger than the (padded) input
        with pytest.raises(stitchflow.StitchflowError):
            stitchflow.compile(fn, (x, w))
        return
    check(fn, x, w)


def test_conv_modules_with_every_padding_mode_and_the_aten_op():
    x = torch.randn(2, 4, 9, 7)
    for mode in ("zeros", "reflect", "replicate", "circular"):
        m = torch.nn.Conv2d(4, 6, 3, stride=(2, 1), padding=1, groups=2, padding_mode=mode)
        check(m, x)
    w, b = torch.randn(5, 4, 2, 3), torch.randn(5)
    check(lambda x: torch.ops.aten.convolution(x, w, b, [1, 2], [1, 0], [2, 1], False, [0, 0], 1), x)


@settings(max_examples=30, deadline=None)
@given(n=st.sampled_from([1, 2, 3]), size=st.integers(1, 5), cin=st.integers(1, 3), cout=st.integers(1, 3),
       groups=st.sampled_from([1, 2]), k=st.integers(1, 3), stride=st.integers(1, 3), dilation=st.integers(1, 2),
       padding=st.integers(0, 2), extra=st.integers(0, 2), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_transposed_convolutions(n, size, cin, cout, groups, k, stride, dilation, padding, extra, bias, dtype):
    conv = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[n]
    x = torch.randn(2, cin * groups, *[size + d for d in range(n)], dtype=dtype)
    w = torch.randn(cin * groups, cout, *[k] * n, dtype=dtype) / (cin * k ** n) ** 0.5
    b = torch.randn(cout * groups, dtype=dtype) if bias else None
    fn = lambda x, w: conv(x, w, b, stride, padding, extra, groups, dilation)  # noqa: E731
    if eager_gives_nothing(fn, x, w):  # output padding not below the stride or the dilation, or nothing left
        with pytest.raises(stitchflow.StitchflowError):
            stitchflow.compile(fn, (x, w))
        return
    check(fn, x, w)


def test_transposed_convolution_layers_and_the_aten_op():
    x = torch.randn(2, 4, 5, 6)
    check(torch.nn.ConvTranspose2d(4, 2, 4, 2, 1), x)  # a decoder's 2x upsampling
    w = torch.randn(4, 3, 3, 2)
    check(lambda x: torch.ops.aten.convolution(x, w, None, [2, 1], [1, 0], [1, 1], True, [1, 0], 1), x)


def test_a_convolution_is_one_contraction_with_its_bias_on_the_dataflow_target():
    x, w, b = torch.randn(2, 3, 6, 5), torch.randn(4, 3, 3, 2), torch.randn(4)
    prog = check(lambda x: F.conv2d(x, w, b, stride=2).relu(), x, target="dataflow", fusion="full")
    contractions = [n for n in prog.graph.nodes if n.reduce == "sum"]
    assert len(contractions) == 1 and len(contractions[0].reduce_vars) == 3


def test_padding_on_the_dataflow_target_is_refused_with_the_reason():
    x = torch.randn(2, 3, 6, 5)
    with pytest.raises(stitchflow.StitchflowError, match="coordinate value"):
        stitchflow.compile(lambda x: F.pad(x, (1, 1)), (x,), target="dataflow")(x)
