"""Interpolation in every mode: captured and interpreted, equal to eager on random sizes and
factors (hypothesis), float32 and bfloat16; nearest by an integer factor is a view."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import stitchflow
from conftest import assert_close, eager_gives_nothing

MODES_2D = ["nearest", "nearest-exact", "bilinear", "bicubic", "area"]


def check(fn, x, target="reference"):
    prog = stitchflow.compile(fn, (x,), target=target)
    expected, actual = fn(x), prog(x)
    assert actual.shape == expected.shape
    assert_close(actual, expected)
    return prog


@settings(max_examples=40, deadline=None)
@given(h=st.integers(1, 9), w=st.integers(1, 9), mode=st.sampled_from(MODES_2D), by_size=st.booleans(),
       out=st.tuples(st.integers(1, 12), st.integers(1, 12)), factor=st.sampled_from([0.5, 1.5, 2, 3, (2, 0.75)]),
       align=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_interpolate_2d(h, w, mode, by_size, out, factor, align, dtype):
    x = torch.randn(2, 3, h, w, dtype=dtype)
    kwargs = dict(size=out) if by_size else dict(scale_factor=factor)
    if mode in ("bilinear", "bicubic"):
        kwargs["align_corners"] = align
    fn = lambda x: F.interpolate(x, mode=mode, **kwargs) * 2  # noqa: E731
    if eager_gives_nothing(fn, x):  # an output size of 0 (a factor below 1 on a short axis)
        return
    check(fn, x)


@pytest.mark.parametrize("mode,shape", [("linear", (2, 3, 7)), ("nearest", (2, 3, 7)), ("trilinear", (1, 2, 3, 4, 5)),
                                        ("nearest", (1, 2, 3, 4, 5)), ("area", (1, 2, 6, 4, 5))])
def test_interpolate_1d_and_3d(mode, shape):
    check(lambda x: F.interpolate(x, scale_factor=2, mode=mode) + 1, torch.randn(shape))
    check(lambda x: F.interpolate(x, size=[3] * (len(shape) - 2), mode=mode), torch.randn(shape))


def test_antialiased_shrinking_and_its_limit():
    x = torch.randn(1, 2, 12, 10)
    check(lambda x: F.interpolate(x, size=(5, 4), mode="bilinear", antialias=True), x)
    with pytest.raises(stitchflow.StitchflowError, match="taps per output point"):
        stitchflow.compile(lambda x: F.interpolate(x, size=(1, 1), mode="bicubic", antialias=True),
                           (torch.randn(1, 1, 40, 40),))


def test_nearest_by_an_integer_factor_is_a_view():
    prog = check(lambda x: F.interpolate(x, scale_factor=2) + 1, torch.randn(1, 2, 3, 4))
    (node,) = prog.graph.nodes
    assert "// 2" in str(node) and not prog.graph.params


def test_a_nan_reaches_only_outputs_that_weigh_it():
    x = torch.randn(1, 2, 9, 8)
    x[0, 0, 2, 3] = float("nan")
    for mode in ("bilinear", "bicubic", "area"):
        fn = lambda x: F.interpolate(x, size=(13, 5), mode=mode)  # noqa: E731
        got, want = stitchflow.compile(fn, (x,))(x), fn(x)
        assert got.isnan().any() and bool((got.isnan() <= want.isnan()).all())
        clean = ~want.isnan()
        assert_close(got[clean], want[clean])
