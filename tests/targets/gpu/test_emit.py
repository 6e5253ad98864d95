"""Addresses (emit.BodyEmitter.offset): an index that adds several tile axis classes, as a view reads its base,
folds into one coordinate per tile axis when the address is affine in whole classes; otherwise index by index."""

import os
import re

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from stitchflow.bench.stitching_patterns import pattern_kernel  # noqa: E402
from stitchflow.targets.gpu.codegen import build_kernel  # noqa: E402
from stitchflow.targets.gpu.mapping import Config  # noqa: E402


def _source(name, shape, dtype, cfg):
    k, strides = pattern_kernel(name, shape, dtype)
    return build_kernel(k.graph, [(k.plans[0], cfg)], strides, False, k.title, k.group_names).source


def _loads(source: str, arg: str) -> list[str]:
    return re.findall(rf"tl\.load\({arg} \+ ([^,)]*)", source)


def test_group_norms_view_reads_x_at_one_coordinate_per_tile_axis():
    """x[i, 16·j + l, m, n] over classes (i, j | l, m, n) is p·4096·16 + l: no div or mod per axis, contiguous."""
    source = _source("groupnorm_silu", (2, 512, 16, 16), torch.bfloat16, Config(1, 1024, 1, 4))
    xs = _loads(source, "in0")  # the statistics' pass and the outputs'
    assert len(xs) == 2 and all(re.fullmatch(r"c\d+ \* 4096 \+ c\d+", x) for x in xs), xs
    # the per-channel weight, w[16·j + l]: the group's channel from p, the channel in the group from l
    ws = _loads(source, "in1")
    assert ws and all(re.fullmatch(r"c\d+ \* 16 \+ c\d+", w) for w in ws), ws


def test_plain_reads_keep_their_runs():
    """A read whose indices are plain variables takes the per-index path (contiguous runs of axes) as before."""
    source = _source("batchnorm_train", (4, 6, 5, 7), torch.float32, Config(1, 256, 1, 4))
    assert all("//" not in a for a in _loads(source, "in0"))


def test_an_infinite_constant_output_in_half_precision():
    """A -inf fill that a masked softmax reads and the program also returns (GPT-3's BigBird mask, whose
    forward saves the fill for the backward): stored and inlined as the constant, not cast (the
    kernel's NEG_INF is a constexpr, which has no .to())."""
    import stitchflow

    def masked_softmax(s, mask):
        fill = torch.full((), float("-inf"), dtype=s.dtype)
        return torch.where(mask == 0, fill, s * 0.25).softmax(-1), fill

    s = torch.randn(2, 6, 8).to(torch.bfloat16)
    mask = (torch.rand(6, 8) > 0.3).to(torch.bfloat16)
    mask[:, 0] = 1  # no row all masked
    prog = stitchflow.compile(masked_softmax, (s, mask), target="gpu", fusion="full")
    (probs, fill), (ref_probs, ref_fill) = prog(s, mask), masked_softmax(s, mask)
    torch.testing.assert_close(probs, ref_probs, rtol=2e-2, atol=2e-2)
    assert fill.dtype == torch.bfloat16 and fill.item() == float("-inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_constant_index_values_cast_as_numbers(dtype):
    """arange's value at a size-1 dim is the literal index 0 (Mamba's backward compares such a position with 0):
    a cast rounds the number, where `0.to(tl.int64)` did not parse and the kernel's program ran eagerly."""
    import stitchflow

    def first_position(x):
        position = torch.arange(x.shape[1]).view(1, -1)[:, :1]
        return x * position.to(dtype) + (position == 0)

    x = torch.randn(5, 1)
    prog = stitchflow.compile(first_position, (x,), target="gpu", fusion="full")
    torch.testing.assert_close(prog(x), first_position(x))


def test_a_module_holds_only_the_helpers_it_names():
    from stitchflow.targets.gpu.codegen_header import header

    def helpers(body, interpret=False):
        return re.findall(r"def (\w+)\(", header("t", interpret, body))

    assert helpers("    return x + 1\n") == []
    # _erf_lowp calls the approximate reciprocal and exp2 (the exact ones under the interpreter)
    assert sorted(helpers("    y = _erf_lowp(x)\n")) == ["_erf_lowp", "_ex2_approx", "_rcp_approx"]
    assert "1.0 / x" in header("t", True, "    y = _erf_lowp(x)\n")
    assert helpers("    m = tl.reduce(x, 1, _max_nan)\n") == ["_max_nan"]  # a combine named, not called
    fmod = helpers("    r = _floordiv_from_fmod(a, b, _fmod_f64(a, b))\n")
    assert fmod == ["_trunc", "_fmod_f64", "_floordiv_from_fmod"]  # _fmod_f64 calls _trunc
    # a generated kernel: softmax's max reduction keeps NaNs, and its module compiles without the other helpers
    k, strides = pattern_kernel("scale_mask_softmax", (6, 50))
    source = build_kernel(k.graph, [(k.plans[0], Config(2, 64, 1, 4))], strides, True, k.title, k.group_names).source
    assert "def _max_nan(" in source and "def _atan2(" not in source
