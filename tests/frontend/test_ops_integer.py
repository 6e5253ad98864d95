"""Integer arithmetic and rounding divisions (floor and truncating division, remainder, fmod, bitwise ops,
shifts, trunc, frac, sign) and indexing by several tensors: captured and run on every target, equal to eager
on random shapes and values of both signs, integers and floats."""


import pytest
import torch
from hypothesis import given, settings, strategies as st

import stitchflow
from conftest import assert_close, skip_unless_kernels_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TARGETS = ["reference", "dataflow", "gpu"]


def check(fn, *inputs, target="reference"):
    skip_unless_kernels_run(target)
    if target == "gpu":
        inputs = tuple(t.to(DEVICE) for t in inputs)
    prog = stitchflow.compile(fn, inputs, target=target)
    expected, actual = fn(*inputs), prog(*inputs)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype.is_floating_point:
        assert_close(actual, expected)
    else:
        assert torch.equal(actual.cpu(), expected.cpu()), (actual, expected)
    return prog


def _ints(shape, lo=-50, hi=50, nonzero=False, dtype=torch.int64):
    x = torch.randint(lo, hi, shape, dtype=dtype)
    return torch.where(x == 0, 7, x) if nonzero else x


INTEGER = {
    "floordiv": lambda a, b: a // b, "floor_divide": lambda a, b: torch.floor_divide(a, b) + a // 3,
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"), "remainder": lambda a, b: a % b + a % -4,
    "fmod": lambda a, b: torch.fmod(a, b), "and_or_xor": lambda a, b: (a & b) + (a | 12) - (a ^ b),
    "not": lambda a, b: ~a * b, "shifts": lambda a, b: (a << 3) + (a >> 2) + (b.abs() >> (a.abs() % 5)),
    "true_div": lambda a, b: a / b, "sign": lambda a, b: torch.sign(a) * b,
    "mixed_with_float": lambda a, b: (a.float() // 2.5) + (a % 2.5) * b,
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(INTEGER))
@settings(max_examples=4, deadline=None)
@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=3))
def test_integer_ops(name, target, shape):
    torch.manual_seed(sum(shape) * 31 + len(shape))  # the same data when hypothesis replays an example
    check(INTEGER[name], _ints(shape), _ints(shape, nonzero=True), target=target)


@pytest.mark.parametrize("target", TARGETS)
def test_int32_and_bool_operands(target):
    a, b = _ints((5, 6), dtype=torch.int32), _ints((5, 6), nonzero=True, dtype=torch.int32)
    check(lambda a, b: (a // b) * (a % 7) + (a & 0xF0), a, b, target=target)
    m, n = a > 0, b > 0
    check(lambda m, n: (m & n) | (~m ^ n), m, n, target=target)  # bools: the logical ops
    check(lambda a, m: a * (m & (a > 3)) + (~m).to(torch.int32), a, m, target=target)


FLOAT = {
    "floordiv": lambda x, y: x // y, "remainder": lambda x, y: torch.remainder(x, y) * 2,
    "fmod": lambda x, y: torch.fmod(x, y) + 1, "div_trunc": lambda x, y: torch.div(x, y, rounding_mode="trunc"),
    "trunc_frac": lambda x, y: torch.trunc(x * 3) + torch.frac(y * 5), "sign": lambda x, y: torch.sign(x) * y,
    "scalars": lambda x, y: (x // 0.3) + (x % -0.7) + torch.fmod(7.0 - x, 2),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(FLOAT))
@settings(max_examples=4, deadline=None)
@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=3))
def test_rounding_divisions_of_floats(name, dtype, target, shape):
    if target == "dataflow" and dtype != torch.float32:
        pytest.skip("the dataflow target streams float32 values")
    torch.manual_seed(sum(shape) * 31 + len(shape))
    x, y = torch.randn(shape) * 10, torch.randn(shape) * 3
    y = torch.where(y.abs() < 0.1, 0.5, y)
    check(FLOAT[name], x.to(dtype), y.to(dtype), target=target)


@pytest.mark.parametrize("target", ["reference", "gpu"])
def test_float_edge_values_divide_as_torch(target):
    """Zero divisors, infinities, NaN, quotients that are whole or just below whole."""
    x = torch.tensor([7.0, -7.0, 7.0, -7.0, 0.0, -0.0, 1.0, float("inf"), 5.0, float("nan"), 0.3, 1e6, -1e-3])
    y = torch.tensor([3.0, 3.0, -3.0, -3.0, 2.0, 2.0, 0.0, 2.0, float("inf"), 1.0, 0.1, 7.0, 5.0])
    for fn in (lambda x, y: x // y, lambda x, y: x % y, lambda x, y: torch.fmod(x, y)):
        check(fn, x, y, target=target)


def test_shifts_beyond_the_width_give_torchs_values():
    a = torch.tensor([5, -5, 5, -5, 1, -1])
    s = torch.tensor([64, 64, 70, 3, 63, 0])
    for target in ("reference", "gpu"):
        check(lambda a, s: (a << s) + (a >> s), a, s, target=target)


def test_the_dunder_forms_of_bitwise_ops_lower_as_the_named_ones():
    """torch.export may keep `a & b` as aten.__and__ (a mask combined inside a submodule's call)."""
    a, b = torch.tensor([5, -6, 0, 7]), torch.tensor([3, 3, -1, 12])
    for op in (torch.ops.aten.__and__.Tensor, torch.ops.aten.__or__.Tensor, torch.ops.aten.__xor__.Tensor):
        check(lambda a, b, op=op: op(a, b) + op(a > 0, b > 0), a, b, target="reference")


def test_bitwise_ops_on_floats_are_refused_with_the_reason():
    with pytest.raises(stitchflow.StitchflowError, match="bitwise_and"):  # eager has no float kernel either
        stitchflow.compile(lambda x: torch.bitwise_and(x, 3), (torch.randn(4),))


INDEXING = {
    "apart": lambda x, i, j: x[i, :, j], "adjacent": lambda x, i, j: x[:, i, j] * 2,
    "leading": lambda x, i, j: x[i, j].exp(), "none_between": lambda x, i, j: x[..., i, None, j] + 1,
    "sliced": lambda x, i, j: x[None, i, 1:, j], "three": lambda x, i, j: x[i[:1], j, j.T] - x[i[:1], j, 0:1],
    "aten_index": lambda x, i, j: torch.ops.aten.index.Tensor(x, [None, i, None, j]),
    "cross_entropy_pick": lambda x, i, j: x[torch.arange(x.shape[0]), i[: x.shape[0]] % x.shape[1]].sum(-1),
}


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("name", sorted(INDEXING))
@settings(max_examples=4, deadline=None)
@given(n=st.integers(2, 5), b=st.integers(1, 3))
def test_indexing_by_several_tensors(name, target, n, b):
    x = torch.randn(n, n + 1, n + 2, n + 3)
    i, j = torch.randint(0, n, (n,)), torch.randint(0, n, (b, 1))
    check(INDEXING[name], x, i, j, target=target)


def test_indexing_by_python_lists():
    x = torch.randn(5, 5, 5)
    check(lambda x: x[[0, 2, 3], [1, 3, 3]] * 2, x)
    check(lambda x: x[:, [0, 3]] + 1, x)


@pytest.mark.parametrize("target", TARGETS)
def test_negative_indices_count_from_the_end(target):
    """x[idx] wraps a negative index as torch does (it was clamped to 0: a wrong answer)."""
    x, i = torch.randn(5, 3), torch.tensor([-1, 0, 2, -5, 4])
    check(lambda x, i: x[i] * 2, x, i, target=target)
    check(lambda x, i: x[i, i % 3 - 3] + 1, x, i, target=target)
    check(lambda x: x[[-1, 1]] * 3, x, target=target)  # a constant list: wrapped when captured
