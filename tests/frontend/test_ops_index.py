"""Products in their other spellings (dot, inner, mv, addmv, addbmm, tensordot, trace, multi_dot, kron) and index
maps with repetition and windows (repeat_interleave, tile, take_along_dim, unfold, diff, cross): on every target,
equal to eager on random shapes in float32 and bfloat16. slice_scatter, select_scatter, index_put
(accumulating) and scatter of a scalar (the gradients AOTAutograd's backward graphs hold; the other scatters are
in test_ops_scatter). OpInfo samples cover their argument variants. Item
assignment (x[key] = v) through the backend, and the refusal of an in-place write into a view."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import stitchflow
from stitchflow import backend
from conftest import assert_close, assert_close_to_truth, skip_unless_kernels_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# x: (a, b, c), y: (a, c, b)
CASES = {
    "dot_inner_mv": lambda x, y: torch.dot(x[0, 0], y[0, :, 0]) + torch.inner(x[0], y[0].T).sum(0)
    + torch.mv(x[0], y[0, :, 0]).sum(),
    "addmv_addbmm": lambda x, y: torch.addmv(x[0, :, 0], x[0], y[0, :, 1], beta=0.5, alpha=2)[:, None]
    + torch.addbmm(x[0, :, :1], x, y[:, :, :1], alpha=0.5),
    # torch 2.11's CPU trace has no bfloat16 kernel
    "tensordot_trace": lambda x, y: torch.tensordot(x, y, dims=([1, 2], [2, 1])) + torch.trace(x[0].float()).to(x.dtype),
    "multi_dot_kron": lambda x, y: torch.linalg.multi_dot([x[0], y[0], x[0]]).sum(0) + torch.kron(x[0, :2, :2], y[0, :1]).sum(),
    "repeat_interleave_tile": lambda x, y: x.repeat_interleave(2, dim=1).sum(1) + torch.tile(y[0, 0], (2,)).sum(),
    "take_along_dim": lambda x, y: torch.take_along_dim(x, (x.abs() * 3).long() % x.shape[2] - 1, 2),
    "unfold_diff": lambda x, y: x.unfold(2, 2, 1).sum(-1)[..., :1] + torch.diff(x, dim=1).sum(1, keepdim=True)
    + torch.diff(x, n=2, dim=2, prepend=x[..., :1]).sum(-1, keepdim=True),
    # a slice's and an index's gradients in AOTAutograd's backward graphs
    "slice_select_scatter": lambda x, y: torch.slice_scatter(x, y.transpose(1, 2)[:, :, 1:] * 2, 2, 1)
    + torch.select_scatter(x, y.transpose(1, 2)[:, 0], 1, -1) + torch.slice_scatter(x, x[:, ::2] - 1, 1, 0, None, 2),
    # an embedding's gradient (rows summed into the table) and NLL's (a one-hot times -1)
    "index_put_accumulate": lambda x, y: torch.index_put(x.new_zeros(5, x.shape[2]), ((x[0, :, 0].abs() * 3).long() % 5,),
                                                         x[0] * 2, accumulate=True),
    # a nearest upsampling's gradient: index tensors that broadcast, after a whole dim (None)
    "index_put_broadcast": lambda x, y: torch.ops.aten.index_put(
        x.new_zeros(x.shape[0], 3, 4), [None, ((x[0, :, 0].abs() * 3).long() % 3)[:, None],
                                         (y[0, 0].abs() * 4).long() % 4], x[:, :, :1] * y[:, :1, :], True),
    "scatter_one_hot": lambda x, y: (x * 3).scatter(2, (y.transpose(1, 2)[..., :1].abs() * 2).long() % x.shape[2], -1.0),
    "cross": lambda x, y: torch.linalg.cross(x[:, :, :3].repeat(1, 1, 2)[..., :3], y.transpose(1, 2)[..., :3].repeat(1, 1, 2)[..., :3]),
}
GATHERS_COMPUTED_INDEX = {"take_along_dim", "index_put_accumulate", "index_put_broadcast", "scatter_one_hot"}


@pytest.mark.parametrize("target", ["reference", "gpu", "dataflow"])
@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=3, deadline=None)
@given(a=st.integers(2, 4), b=st.integers(2, 5), c=st.integers(3, 6), half=st.booleans())
def test_products_and_index_maps_equal_eager(name, target, a, b, c, half):
    if target == "dataflow" and (name in GATHERS_COMPUTED_INDEX or half):
        pytest.skip("the dataflow target streams float32 and cannot stream an index computed in the same region")
    skip_unless_kernels_run(target)
    g = torch.Generator().manual_seed(a * 100 + b * 10 + c)
    dtype = torch.bfloat16 if half else torch.float32
    x, y = torch.randn(a, b, c, generator=g).to(dtype), torch.randn(a, c, b, generator=g).to(dtype)
    fn = CASES[name]
    if target == "gpu":
        x, y = x.to(DEVICE), y.to(DEVICE)
    prog = stitchflow.compile(fn, (x, y), target=target, fusion="full")
    assert_close_to_truth(prog(x, y), fn, (x, y))


def test_refusals_name_the_problem():
    x = torch.randn(3, 4)
    with pytest.raises(stitchflow.StitchflowError, match="data-dependent shape"):
        stitchflow.compile(lambda x: x.repeat_interleave((x[0] > 0).long() + 1, dim=1), (x,))
    with pytest.raises(stitchflow.StitchflowError, match="must have length 3"):
        stitchflow.compile(lambda x: torch.linalg.cross(x, x), (x,))
    rows = torch.tensor([0, 2, 0])
    with pytest.raises(stitchflow.StitchflowError, match="index tensors apart"):
        stitchflow.compile(lambda x: torch.ops.aten.index_put(x[None], [rows * 0, None, rows], x[:3, :3], True), (x,))


def _row(y, v):
    y[0] = 5.0


def _columns(y, v):
    y[:, 1:4] = v[:, :3]


def _strided(y, v):
    y[1::2, ::3] = v[:y[1::2].shape[0], :y[:, ::3].shape[1]]


def _last(y, v):
    y[..., -1] = v[:, 0]


def _masked(y, v):
    y[y > 1] = 0.0


def _broadcast_rows(y, v):
    y[1:3] = v[0]


def _twice(y, v):
    y[:, 0] = 1.0
    y[-1, :] = v[0] * 2


def _augmented(y, v):
    """x[key] += v: Dynamo records the item read, an in-place add into that view, and the item assigned back."""
    y[:, 0] += v[:, 1]
    y[1:3] *= 2


def _augmented_by_index(y, v):
    y[torch.tensor([4, 1])] -= v[0]


SETITEMS = [_row, _columns, _strided, _last, _masked, _broadcast_rows, _twice, _augmented, _augmented_by_index]


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("write", SETITEMS, ids=lambda f: f.__name__.strip("_"))
def test_item_assignment_through_the_backend(write, target):
    """x[key] = v under torch.compile (Dynamo records operator.setitem): a new value of x, no fallback."""
    skip_unless_kernels_run(target)

    def f(x, v):
        y = x * 2
        write(y, v)
        return y.softmax(-1)

    x, v = torch.randn(6, 7), torch.randn(6, 7)
    if target == "gpu":
        x, v = x.to(DEVICE), v.to(DEVICE)
    backend.reset()
    torch._dynamo.reset()
    out = torch.compile(f, backend="stitchflow", options={"target": target})(x, v)
    assert_close_to_truth(out, f, (x, v))
    assert backend.FALLBACKS == [], backend.fallback_report()


def test_a_write_into_a_view_is_not_lost():
    """z[0].add_(1) changes z in eager; the IR's values are not aliased, so capture refuses it with the reason
    (it once changed only the view's value). stitchflow.compile then takes torch.export's functionalized graph
    (z[0] written back by select_scatter); the backend runs that partition eagerly."""
    def f(x):
        z = x * 2
        z[0].add_(1)
        return z

    x = torch.randn(3, 4)
    assert_close(stitchflow.compile(f, (x,))(x), f(x))
    backend.reset()
    torch._dynamo.reset()
    assert_close_to_truth(torch.compile(f, backend="stitchflow")(x), f, (x,))
    assert "shares memory" in backend.fallback_report()


def test_a_write_into_an_item_read_again_is_refused():
    """y[0] += 1 is safe to take as a new value only because the item is assigned back right away; a view read
    once more after its in-place write is not that, and stays refused."""
    def f(x):
        z = x * 2
        row = z[0]
        row += 1
        return z, row * 3

    x = torch.randn(3, 4)
    backend.reset()
    torch._dynamo.reset()
    for got, want in zip(torch.compile(f, backend="stitchflow")(x), f(x)):
        assert_close(got, want)
    assert "shares memory" in backend.fallback_report()


def _chained_writes(x):
    y = x.clone()
    y.mul_(2).add_(1)  # add_ writes the tensor mul_ returned, which is y
    z = y.relu_()
    z.sub_(0.5)
    return y, z * 3


def _write_through_a_result_after_a_read(x):
    y = x.clone()
    w = y.add_(1) * 2  # read before the next write through the result
    y.add_(1).mul_(3)
    return w, y


@pytest.mark.parametrize("f", [_chained_writes, _write_through_a_result_after_a_read])
def test_writes_through_an_in_place_result_reach_the_tensor(f):
    """An in-place op returns the tensor it wrote, so y.mul_(2).add_(1) writes y twice; capture once
    rebound only the result's name, and y came out without the + 1."""
    x = torch.randn(4, 5)
    backend.reset()
    torch._dynamo.reset()
    out = torch.compile(f, backend="stitchflow")(x)
    for got, want in zip(out, f(x)):
        assert_close(got, want)
    assert backend.FALLBACKS == [], backend.fallback_report()


@pytest.mark.parametrize("target", ["reference", "gpu"])
def test_index_put_wraps_negative_indices(target):
    """x.index_put((i,), v, accumulate=True) with i below 0 counts from the end, as eager does (a later
    call with a negative index raised IndexError out of a program compiled on non-negative ones)."""
    skip_unless_kernels_run(target)

    def f(x, i, v):
        return x.index_put((i,), v, accumulate=True) * 2

    compiled = torch.compile(f, backend="stitchflow", options={"target": target})
    x, v = torch.zeros(5, 6), torch.randn(3, 6)
    for i in (torch.tensor([0, 1, 1]), torch.tensor([-1, 2, -5]), torch.tensor([-2, -2, 4])):
        if target == "gpu":
            x, v, i = x.to(DEVICE), v.to(DEVICE), i.to(DEVICE)
        assert_close(compiled(x, i, v), f(x, i, v))
