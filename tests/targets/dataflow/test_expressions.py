"""Random expressions over sparse tensors of random formats and densities equal eager torch,
unfused and fully fused."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stitchflow
from conftest import assert_close

FORMATS = ["dense", "csr", "dcsr", "csc", "dcsc"]
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def sparse(shape, density, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=g) < density
    return torch.where(mask, torch.rand(shape, generator=g) + 0.5, torch.zeros(()))


def dense(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def check(fn, inputs, formats, fusion, options=None):
    prog = stitchflow.compile(fn, inputs, target="dataflow", fusion=fusion, formats=formats, options=options)
    assert_close(prog(*inputs), fn(*inputs))
    return prog


dims = st.integers(1, 9)
density = st.sampled_from([0.01, 0.1, 0.3, 0.7, 1.0])
fmt = st.sampled_from(FORMATS)
fusion = st.sampled_from(["unfused", "full"])
seed = st.integers(0, 10_000)


@SETTINGS
@given(m=dims, k=dims, n=dims, d=density, f=fmt, fu=fusion, s=seed)
def test_spmm(m, k, n, d, f, fu, s):
    check(lambda a, b: a @ b, (sparse((m, k), d, s), dense((k, n), s + 1)), {0: f}, fu)


@SETTINGS
@given(m=dims, k=dims, n=dims, d=density, f=fmt, s=seed)
def test_sddmm(m, k, n, d, f, s):
    fn = lambda mask, a, b: mask * (a @ b)  # noqa: E731
    check(fn, (sparse((m, n), d, s), dense((m, k), s + 1), dense((k, n), s + 2)), {0: f}, "full")


@SETTINGS
@given(m=dims, n=dims, d=density, f=fmt, fu=fusion, s=seed)
def test_masked_softmax(m, n, d, f, fu, s):
    mask = sparse((m, n), d, s)
    mask[torch.arange(m), torch.arange(m) % n] = 1.0  # no fully masked row
    fn = lambda mk, x: torch.softmax(x.masked_fill(mk == 0, float("-inf")), dim=-1)  # noqa: E731
    check(fn, (mask, dense((m, n), s + 1)), {0: f}, fu)


@SETTINGS
@given(m=dims, n=dims, d1=density, d2=density, f1=fmt, f2=fmt, s=seed,
       op=st.sampled_from(["add", "sub", "mul", "max", "relu_add", "scaled"]))
def test_sparse_elementwise(m, n, d1, d2, f1, f2, s, op):
    fns = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
           "max": lambda a, b: torch.maximum(a, b), "relu_add": lambda a, b: torch.relu(a - b) + a * b,
           "scaled": lambda a, b: 2.0 * a - b / 4.0}
    check(fns[op], (sparse((m, n), d1, s), sparse((m, n), d2, s + 1)), {0: f1, 1: f2}, "full")


@SETTINGS
@given(m=dims, k=dims, l=dims, n=dims, d=density, fs=st.lists(fmt, min_size=3, max_size=3), fu=fusion, s=seed)
def test_chain_abc(m, k, l, n, d, fs, fu, s):
    ins = (sparse((m, k), d, s), sparse((k, l), d, s + 1), sparse((l, n), d, s + 2))
    check(lambda a, b, c: a @ b @ c, ins, dict(enumerate(fs)), fu)


@SETTINGS
@given(m=dims, k=dims, n=dims, d=density, fs=st.lists(fmt, min_size=3, max_size=3), s=seed)
def test_a_times_b_plus_c(m, k, n, d, fs, s):
    ins = (sparse((m, k), d, s), sparse((k, n), d, s + 1), sparse((k, n), d / 2, s + 2))
    check(lambda a, b, c: a @ (b + c), ins, dict(enumerate(fs)), "full")


@SETTINGS
@given(m=dims, n=dims, d=density, f=fmt, s=seed, how=st.sampled_from(["rows", "cols", "all", "rowmax", "mean"]))
def test_reductions(m, n, d, f, s, how):
    fns = {"rows": lambda a: a.sum(1), "cols": lambda a: a.sum(0), "all": lambda a: (a * a).sum(),
           "rowmax": lambda a: (a - 0.7).amax(1), "mean": lambda a: a - a.mean(1, keepdim=True)}
    check(fns[how], (sparse((m, n), d, s),), {0: f}, "full")


def test_gnn_layer_chain_fused_and_unfused():
    a, x, w = sparse((12, 12), 0.2, 1), dense((12, 5), 2), sparse((5, 3), 0.5, 3)
    fn = lambda a, x, w: torch.softmax(a @ torch.relu(a @ x @ w + 1.0) @ w.t() @ w, dim=-1)  # noqa: E731
    for fu in ("unfused", "partial", "full"):
        check(fn, (a, x, w), {0: "dcsr", 2: "dcsr"}, fu)


def test_recomputation_shows_in_stream_lengths():
    """Full fusion of a(relu(a b)) in FuseFlow's streamed order (the inner product inside the
    outer loops, no hoisting) rescans a's rows per outer coordinate: more tokens than unfused."""
    a, b = sparse((16, 16), 0.3, 5), dense((16, 4), 6)
    fn = lambda a, b: a @ torch.relu(a @ b)  # noqa: E731

    def tokens(fusion, options=None):
        prog = check(fn, (a, b), {0: "csr"}, fusion, options)
        return sum(c.tokens for c in prog._compiled)

    streamed = tokens("full", {"order": ("i", "k", "k1", "j"), "hoist": False})
    assert streamed > 2 * tokens("unfused")


@pytest.mark.parametrize("f", FORMATS)
def test_transposed_access(f):
    a = sparse((6, 4), 0.4, 9)
    check(lambda a, b: a.t() @ b, (a, dense((6, 3), 1)), {0: f}, "full")


@SETTINGS
@given(m=dims, n=dims, d=density, f=fmt, fu=fusion, s=seed, keep=st.sampled_from([0, 1]))
def test_broadcast_axes_no_input_reads(m, n, d, f, fu, s, keep):
    """Output axes that no input indexes (a keepdim reduction's size-1 axis, an expand) are
    iterated too; they were once missing from the order's variables (KeyError)."""
    inputs = [sparse((m, n), d, s), dense((m, n), s + 1)]
    check(lambda a, x: ((a * x).sum(keep, keepdim=True) + x.amax(keep, keepdim=True)) * 2, inputs, {0: f}, fu)
    check(lambda a, x: (x[0] * 2).expand(3, n) + a.sum(0), inputs, {0: f}, fu)


@SETTINGS
@given(m=dims, n=dims, fu=fusion, s=seed)
def test_two_slices_of_one_dense_dimension(m, n, fu, s):
    """y[:, :n] * y[:, n:]: a plain read over part of a dimension is addressed at its extent (it
    was scanned whole, and the write ran past the output: IndexError)."""
    y = dense((m, 2 * n + 1), s)
    check(lambda y: y[:, :n] * torch.sigmoid(y[:, n:2 * n]) + y[:, 1:n + 1], [y], {}, fu)
