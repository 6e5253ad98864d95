"""Values at the edges on the gpu target under TRITON_INTERPRET=1, each once wrong (found by fuzzing
against eager): integer reductions past float32's 2**24 (they accumulated in float32), unsigned minima
(-max(-x) wraps), a split row's piece of -inf in a softmax, whole powers of negative bases, expm1 and
log1p near float32's largest values."""

import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("STITCHFLOW_CACHE", tempfile.mkdtemp(prefix="stitchflow-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402

import stitchflow  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests on CPU tensors: a GPU session (TRITON_INTERPRET=0) "
                                "runs the device checks (scripts/kernel_check_probe.py) instead")


def _reductions(x):
    return x.sum(-1), x.amax(-1), x.argmax(-1), x.amin(-1), x.argmin(-1), x.cumsum(-1)[:, -1]


@pytest.mark.parametrize("dtype, low, high", [(torch.int32, 2**30 - 50, 2**30), (torch.int64, 2**40, 2**40 + 99),
                                              (torch.int32, -2**31, 2**31 - 1), (torch.uint8, 0, 256)])
@pytest.mark.parametrize("options", [{}, {"block_l": 16, "split": 4}])
def test_integer_reductions_are_exact(dtype, low, high, options):
    x = torch.randint(low, high, (3, 64), dtype=torch.int64, generator=torch.Generator().manual_seed(0)).to(dtype)
    if dtype == torch.uint8:
        x[0, :3] = torch.tensor([0, 5, 200], dtype=dtype)
    prog = stitchflow.compile(_reductions, (x,), target="gpu", fusion="full", options=options)
    for got, want in zip(prog(x), _reductions(x)):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("dim", [-1, 0])
def test_a_split_piece_of_minus_infinity_keeps_the_softmax_finite(dim):
    """A padding mask fills the last piece of a split row with -inf: its partial sum was exp(-inf - -inf)."""
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    x[0, 48:] = float("-inf")
    x = x if dim == -1 else x.T.contiguous()
    for fn in (torch.softmax, torch.log_softmax):
        f = lambda x: fn(x, dim)  # noqa: E731
        prog = stitchflow.compile(f, (x,), target="gpu", fusion="full", options={"block_l": 16, "split": 4})
        torch.testing.assert_close(prog(x), f(x))


@pytest.mark.parametrize("exponent", [-1, 0, 5, 7, -3])
def test_whole_powers_of_negative_bases(exponent):
    x = torch.tensor([-2.0, -0.5, 0.0, 0.5, 3.0, float("nan")])
    f = lambda x: x ** exponent  # noqa: E731
    torch.testing.assert_close(stitchflow.compile(f, (x,), target="gpu")(x), f(x), equal_nan=True)
    n = torch.tensor([3, 99, -2, 7])
    if exponent >= 0:
        assert torch.equal(stitchflow.compile(f, (n,), target="gpu")(n), f(n))


def test_expm1_and_log1p_near_the_largest_float32():
    x, y = torch.tensor([85.0, 88.0, 88.7, 1e-8]), torch.tensor([1e37, 3e38, 1e-8, 0.5])
    f = lambda x, y: (torch.expm1(x), torch.log1p(y))  # noqa: E731
    for got, want in zip(stitchflow.compile(f, (x, y), target="gpu")(x, y), f(x, y)):
        torch.testing.assert_close(got, want)


def test_a_scalar_truth_beside_a_tiles():
    """`(x > 0) & (s[0] > 0)`: one element's boolean (a scalar load) beside a tile's. Triton's interpreter refused
    `tile & scalar` of booleans; the kernel selects instead."""
    fn = lambda x, s: torch.where((x > 0) & (s[0] > 0), x, -1.0) + torch.where((x < 0) | (s[1] < 0), 1.0, 0.0)  # noqa: E731
    x, s = torch.randn(3, 7, generator=torch.Generator().manual_seed(0)), torch.tensor([0.5, -0.5])
    prog = stitchflow.compile(fn, (x, s), target="gpu", fusion="full")  # the comparisons inside the tile's kernel
    for scalars in (s, -s):
        assert torch.equal(prog(x, scalars), fn(x, scalars))
