"""Grouped matrix products (torch._grouped_mm, F.grouped_mm, transformers' grouped_mm_fallback and its backward)
on the reference and gpu targets against a per-group loop and eager: every form (rows, columns, jagged K, batched),
empty groups, positions past the last offset (zeros here; eager leaves them uninitialised, so eager is compared
inside the groups only), float32 and bfloat16, gradients through the backend."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

import stitchflow
from stitchflow import backend
from stitchflow.ir.errors import ShapeError, UnsupportedOpError
from conftest import assert_close, skip_unless_kernels_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def grouped(a, b, offs):
    return torch._grouped_mm(a, b, offs=offs)


def batched(a, b):
    return torch._grouped_mm(a, b)


def looped(form: str, a, b, offs):
    """The definition, group by group, in float64; positions past offs[-1] zero."""
    a, b, start = a.double(), b.double(), 0
    ends = offs.tolist()
    if form == "rows":
        out = a.new_zeros(a.shape[0], b.shape[2])
    elif form == "columns":
        out = a.new_zeros(a.shape[1], b.shape[1])
    else:
        out = a.new_zeros(len(ends), a.shape[0], b.shape[1])
    for e, end in enumerate(ends):
        if form == "rows":
            out[start:end] = a[start:end] @ b[e]
        elif form == "columns":
            out[:, start:end] = a[e] @ b[:, start:end]
        else:
            out[e] = a[:, start:end] @ b[start:end]
        start = end
    return out


def _inputs(form: str, sizes, tail: int, k: int, n: int, dtype, g):
    """Operands with groups of `sizes` along the jagged dim and `tail` positions past the last group."""
    length, groups = sum(sizes) + tail, len(sizes)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    make = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    if form == "rows":
        return make(length, k), make(groups, k, n), offs
    if form == "columns":
        return make(groups, n, k), make(length, k).t(), offs  # column-major: eager wants 16-byte strides
    return make(length, n).t(), make(length, k), offs  # a column-major, as AOTAutograd's xᵀ


def _inside(form: str, t, end: int):
    return t[:end] if form == "rows" else t[:, :end] if form == "columns" else t


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("form", ["rows", "columns", "jagged"])
@settings(max_examples=4, deadline=None)
@given(sizes=st.lists(st.integers(0, 7), min_size=1, max_size=5), tail=st.integers(0, 3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2 ** 16))
def test_grouped_mm_equals_the_per_group_loop_and_eager(form, target, sizes, tail, dtype, seed):
    skip_unless_kernels_run(target)
    tail = tail if sum(sizes) + tail else 1  # zero-size operands are refused
    g = torch.Generator().manual_seed(seed)
    a, b, offs = (t.to(DEVICE) for t in _inputs(form, sizes, tail, 8, 16, dtype, g))
    prog = stitchflow.compile(grouped, (a, b, offs), target=target, fusion="auto")
    out = prog(a, b, offs).cpu()
    truth = looped(form, a.cpu(), b.cpu(), offs.cpu())
    assert out.dtype == dtype and out.shape == truth.shape
    assert_close(out, truth.to(dtype))
    if sum(sizes) and (dtype == torch.bfloat16 or DEVICE == "cpu"):  # eager's CUDA kernels take bfloat16 only
        eager = grouped(a, b, offs).cpu()
        assert_close(_inside(form, out, sum(sizes)), _inside(form, eager, sum(sizes)))


@pytest.mark.parametrize("target", ["reference", "gpu"])
def test_batched_grouped_mm_is_a_bmm(target):
    skip_unless_kernels_run(target)
    a, b = torch.randn(3, 5, 8, device=DEVICE), torch.randn(3, 8, 16, device=DEVICE)
    prog = stitchflow.compile(batched, (a, b), target=target, fusion="auto")
    assert_close(prog(a, b), a @ b)


def test_a_new_call_takes_new_group_sizes():
    """The groups are data: one program serves every routing of the same shapes."""
    g = torch.Generator().manual_seed(0)
    a, b, offs = _inputs("rows", [3, 0, 5], 2, 8, 16, torch.float32, g)
    prog = stitchflow.compile(grouped, (a, b, offs), target="reference")
    for sizes in ([0, 0, 10], [10, 0, 0], [1, 2, 3]):
        new = torch.tensor(sizes).cumsum(0).to(torch.int32)
        assert_close(prog(a, b, new), looped("rows", a, b, new).float())


def test_bad_operands_name_the_op_and_the_problem():
    """Eager's own checks come first (capture runs the op); the lowering's guard what they let through."""
    a, offs = torch.randn(6, 8), torch.tensor([2, 6], dtype=torch.int32)
    with pytest.raises(ShapeError, match="_grouped_mm.*batch sizes"):
        stitchflow.compile(grouped, (a, torch.randn(3, 8, 16), offs))
    from stitchflow.frontend.ops_grouped import grouped_mm
    from stitchflow.frontend.values import identity
    with pytest.raises(UnsupportedOpError, match="offs must be a 1-D int32 tensor"):
        grouped_mm(SimpleNamespace(hint="g"), identity("a", (6, 8), torch.float32), identity("b", (2, 8, 16), torch.float32),
                   identity("offs", (2,), torch.float32), "grouped_mm")


def test_gradients_through_the_backend_in_bfloat16(fresh_dynamo):
    """AOTAutograd's backward of the rows form is a rows form (the input's gradient) and a jagged-K form (the
    weights'): no fallback, gradients equal eager's inside the groups."""
    g = torch.Generator().manual_seed(3)
    a, b, offs = _inputs("rows", [4, 0, 8, 4], 0, 16, 32, torch.bfloat16, g)

    def step(fn, a, b):
        a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
        (fn(a, b, offs).float() ** 2).sum().backward()
        return a.grad, b.grad

    compiled = torch.compile(grouped, backend="stitchflow", options={"target": "reference"})
    for ours, eager in zip(step(compiled, a, b), step(grouped, a, b)):
        assert_close(ours, eager)
    assert not backend.FALLBACKS, backend.fallback_report()


def test_transformers_fallback_and_its_backward_lower():
    """transformers' custom ops for non-bfloat16 experts: forward and backward equal the ops themselves."""
    pytest.importorskip("transformers.integrations.moe")
    ops = torch.ops.transformers
    g = torch.Generator().manual_seed(5)
    x, w, offs = _inputs("rows", [3, 0, 4], 2, 6, 10, torch.float32, g)
    dy = torch.randn(9, 10, generator=g)
    forward = stitchflow.compile(lambda x, w, o: ops.grouped_mm_fallback(x, w, o), (x, w, offs))
    assert_close(forward(x, w, offs), ops.grouped_mm_fallback(x, w, offs))
    backward = stitchflow.compile(lambda x, w, o, dy: ops.grouped_mm_fallback_backward(x, w, o, dy),
                                  (x, w, offs, dy))
    for ours, theirs in zip(backward(x, w, offs, dy), ops.grouped_mm_fallback_backward(x, w, offs, dy)):
        assert_close(ours, theirs)
