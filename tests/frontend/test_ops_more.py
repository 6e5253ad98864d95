"""The view ops (roll, flip, triangles, diagonals, pixel shuffles, one-hot, as_strided), the rest of F's activations,
trigonometric and hyperbolic functions and their inverses, the composite reductions (logsumexp, any/all, norms of any order, similarity) and the losses: on the
reference and gpu targets (the dataflow target for those without coordinate values), equal to eager on
random shapes in float32 and bfloat16. OpInfo samples cover their argument variants (test_opinfo)."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import stitchflow
from conftest import assert_close_to_truth, skip_unless_kernels_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = {
    "roll": lambda x, y: torch.roll(x, (1, -2), (0, 2)) + torch.roll(y, 3) * 2,
    "flip": lambda x, y: torch.flip(x, (0, -1)) - y.fliplr(),
    "triangles": lambda x, y: torch.tril(x, -1) + torch.triu(y, 1),
    "diagonal": lambda x, y: torch.diagonal(x, 1, 1, 2) * 2 + torch.diagonal(y, -1, 1, 2).sum(-1, keepdim=True),
    "movedim": lambda x, y: torch.movedim(x, (0, 2), (2, 0)) + 1,
    "pixel_shuffle": lambda x, y: F.pixel_unshuffle(F.pixel_shuffle(x.repeat(1, 4, 1, 1)[None], 2), 2)[0] * 2,
    "one_hot": lambda x, y: F.one_hot((x.abs() * 3).long() % 4, 4).sum(1) + 1,
    "activations": lambda x, y: F.selu(x) + F.celu(y, 0.5) + F.logsigmoid(x) + F.softsign(y) + F.hardshrink(x)
    + F.softshrink(y) + F.threshold(x, 0.1, 2.0) + F.tanhshrink(y),
    "logs": lambda x, y: torch.log2(x.abs() + 1) + torch.log10(y.abs() + 1) + torch.exp2(x) + torch.logit(y.sigmoid()),
    "nan_tests": lambda x, y: torch.nan_to_num((x / (y > 0)).log()) + torch.isfinite(x.log()) + torch.isnan(y.sqrt()),
    "fused_ops": lambda x, y: torch.addcmul(x, y, x, value=0.5) + torch.addcdiv(x, y, x.abs() + 1) + torch.lerp(x, y, 0.7)
    + torch.hypot(x, y) + torch.logaddexp(x, y) + torch.xlogy(x.relu(), y.abs()) + torch.fmax(x.log(), y),
    "logsumexp": lambda x, y: torch.logsumexp(torch.where(y > 1, -math.inf, x), (0, 2)) + x.logsumexp(-1).sum(),
    "any_all": lambda x, y: (x > 0).any(-1).float() + (y > -1).all(1, keepdim=True).float().sum(-1)
    + torch.count_nonzero(x > 0.5, -1),
    "norms": lambda x, y: torch.linalg.vector_norm(x, 3, -1) + torch.norm(y, 0.5, -1) + torch.linalg.norm(x, -math.inf, -1)
    + torch.linalg.norm(y, dim=(0, 2)).sum(),
    "similarity": lambda x, y: F.cosine_similarity(x, y, -1) + F.pairwise_distance(x, y) + F.normalize(x, dim=0).sum(-1)
    + torch.cdist(x.float(), y.float(), 1.5).sum(-1).to(x.dtype),  # eager has no bfloat16 cdist
    "var_mean": lambda x, y: torch.var_mean(x, -1)[0] * torch.std_mean(y, -1, correction=0)[1],
    "softmin_outer": lambda x, y: F.softmin(x, -1).sum(-1) + torch.outer(x[0, 0], y[0, 0]).sum(),
    "regression_losses": lambda x, y: F.mse_loss(x, y) + F.l1_loss(x, y, reduction="sum") + F.smooth_l1_loss(x, y, beta=0.5)
    + F.huber_loss(x, y, delta=0.7),
    "probability_losses": lambda x, y: F.binary_cross_entropy_with_logits(x, y.sigmoid(), pos_weight=y[0, 0].abs())
    + F.binary_cross_entropy(x.sigmoid(), y.sigmoid()) + F.kl_div(x.log_softmax(-1), y.softmax(-1), reduction="batchmean"),
    "class_losses": lambda x, y: F.cross_entropy(x.flatten(1), (y[:, 0, 0].abs() * 9).long() % x[0].numel())
    + F.nll_loss(x.log_softmax(1), (y[:, :1, :].abs() * 9).long().squeeze(1) % x.shape[1], ignore_index=2),
    "trig": lambda x, y: torch.tan(x * 0.5) + torch.asin(y.tanh()) + torch.acos(x.tanh() * 0.9) + torch.atan(y)
    + torch.atan2(x, y),
    "hyperbolic": lambda x, y: torch.sinh(x * 3) + torch.cosh(y) + torch.asinh(x * 10) + torch.acosh(y.abs() + 1)
    + torch.atanh(x.tanh() * 0.99),
    "angles": lambda x, y: torch.sinc(x) + torch.rad2deg(torch.deg2rad(y)) + torch.copysign(x, y) + torch.signbit(y),
    "products": lambda x, y: torch.prod(x.sigmoid() + 0.5, -1) + (y > 0).prod(1).sum(-1, keepdim=True)
    + torch.cumprod(x.tanh() + 1, 2)[..., -1] + x.prod(),
    "scans": lambda x, y: torch.cummax(x, 1).values + torch.cummin(y, 2)[1].to(x.dtype) + torch.logcumsumexp(x, 0),
    "baddbmm": lambda x, y: torch.baddbmm(x[:, :, :1], x, y.transpose(1, 2), beta=0.5, alpha=2),
    "as_strided": lambda x, y: _strided_views(x * 2 - y, *x.shape),
    "as_strided_scatter": lambda x, y: torch.as_strided_scatter(x * 0, (x + y).flatten() * 2, (x.numel(),), (1,))
    + torch.ops.aten.copy(x, y[:1] * 3),
    # (a MoE router's tokens per expert: integer-valued floats over [0, experts - 1])
    "histc": lambda x, y: torch.cat([torch.histc((x * y).float(), 7, -1.5, 2.0) * 2,
                                     torch.histc(x.float().round(), 4, 0, 3)]),
}


def _strided_views(t, a, b, c):
    """Views of a fresh tensor through explicit strides (functionalization's as_strided): a transpose of its first
    a·b elements, rows at an offset, a reshape, and overlapping windows; summed to one shape."""
    transposed = t.as_strided((b, a), (1, b)).sum(0)
    rows = t.as_strided((a, c), (b * c, 1), c).sum(-1)
    reshaped = t.as_strided((a * b, c), (c, 1)).view(a, b, c)[:, 0, 0]
    windows = t.as_strided((a, b * c - 1, 2), (b * c, 1, 1)).amax((1, 2))
    return transposed + rows + reshaped + windows
ITERATES_COORDINATES = {"triangles", "one_hot", "class_losses", "roll", "pixel_shuffle", "diagonal", "scans"}
NO_DATAFLOW_REDUCER = {"products"}  # a dataflow Reduce accumulates sums and maxima


def _check(fn, inputs, target):
    skip_unless_kernels_run(target)
    if target == "gpu":
        inputs = tuple(t.to(DEVICE) for t in inputs)
    prog = stitchflow.compile(fn, inputs, target=target)
    assert_close_to_truth(prog(*inputs), fn, inputs)


@pytest.mark.parametrize("target", ["reference", "gpu", "dataflow"])
@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=3, deadline=None)
@given(a=st.integers(2, 4), b=st.integers(2, 5), c=st.integers(2, 6), half=st.booleans())
def test_more_ops_equal_eager(name, target, a, b, c, half):
    if target == "dataflow" and (name in ITERATES_COORDINATES or name in NO_DATAFLOW_REDUCER or half):
        pytest.skip("the dataflow target streams float32, reads no coordinate values and reduces by sum or max")
    g = torch.Generator().manual_seed(a * 100 + b * 10 + c)
    dtype = torch.bfloat16 if half else torch.float32
    x, y = torch.randn(a, b, c, generator=g).to(dtype), torch.randn(a, b, c, generator=g).to(dtype)
    _check(CASES[name], (x, y), target)


def test_refusals_name_the_problem():
    x = torch.randn(3, 4)
    with pytest.raises(stitchflow.StitchflowError, match="its own storage"):
        stitchflow.compile(lambda x: x.as_strided((2, 2), (1, 2)) + 1, (x,))
    with pytest.raises(stitchflow.StitchflowError, match="the data's own minimum and maximum"):
        stitchflow.compile(lambda x: torch.histc(x, 5), (x,))
    with pytest.raises(stitchflow.StitchflowError, match="covers part of its input"):
        stitchflow.compile(lambda x: torch.as_strided_scatter(x * 2, x[0] * 3, (4,), (1,), 4), (x,))
    with pytest.raises(stitchflow.StitchflowError, match="num_classes=-1"):
        stitchflow.compile(lambda x: F.one_hot(x.long().abs()), (x,))
    with pytest.raises(stitchflow.StitchflowError, match="no dataflow reducer"):
        stitchflow.compile(lambda x: x.prod(1), (x,), target="dataflow")
    with pytest.raises(stitchflow.StitchflowError, match="random slope"):
        stitchflow.compile(lambda x: F.rrelu(x, training=True), (x,))
    with pytest.raises(stitchflow.StitchflowError, match="size_average"):
        stitchflow.compile(lambda x: F.mse_loss(x, x * 2, size_average=False), (x,))
    with pytest.raises(stitchflow.StitchflowError, match="matrix norm ord=2"):
        stitchflow.compile(lambda x: torch.linalg.norm(x, 2), (x,))
