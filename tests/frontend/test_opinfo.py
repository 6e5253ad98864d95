"""PyTorch's OpInfo samples for the ops stitchflow supports, on the reference target and on the gpu
target's generated kernels (under the interpreter): each sample either compiles and equals eager, or
is refused with a StitchflowError that names the problem. Never a wrong answer, never an unexplained
crash; and most samples of each op must be supported (counted on the reference target)."""

import os

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

import stitchflow
from conftest import assert_close

OPS = [
    "add", "sub", "mul", "div", "neg", "abs", "exp", "log", "sqrt", "rsqrt", "reciprocal", "tanh", "sigmoid",
    "sin", "cos", "floor", "ceil", "round", "log1p", "expm1",
    "erf", "nn.functional.relu", "nn.functional.gelu", "nn.functional.silu", "nn.functional.softplus",
    "nn.functional.hardtanh", "nn.functional.relu6", "nn.functional.hardsigmoid", "nn.functional.hardswish",
    "nn.functional.elu", "nn.functional.mish", "nn.functional.leaky_relu", "softmax", "log_softmax",
    "nn.functional.layer_norm", "nn.functional.rms_norm", "sum", "mean", "amax", "amin", "argmax", "argmin", "var", "std", "transpose",
    "permute", "reshape", "view", "expand", "masked_fill", "where", "matmul", "mm", "bmm", "einsum",
    "nn.functional.linear", "t", "unsqueeze", "squeeze", "flatten", "clamp", "maximum", "minimum", "pow", "narrow",
    "select", "index_select", "gather", "nn.functional.embedding", "nn.functional.glu", "cat", "stack", "norm", "linalg.vector_norm", "chunk", "split", "repeat", "addmm", "nn.functional.dropout",
    "nn.functional.batch_norm", "nn.functional.group_norm", "nn.functional.conv1d", "nn.functional.conv2d",
    "nn.functional.conv3d", "nn.functional.pad", "constant_pad_nd", "nn.functional.avg_pool1d",
    "nn.functional.avg_pool2d", "nn.functional.avg_pool3d", "nn.functional.max_pool1d", "nn.functional.max_pool2d",
    "nn.functional.interpolate",
    "nn.functional.upsample_bilinear", "nn.functional.upsample_nearest", "nn.functional.adaptive_avg_pool1d",
    "nn.functional.adaptive_avg_pool2d", "nn.functional.adaptive_avg_pool3d", "nn.functional.conv_transpose1d",
    "nn.functional.conv_transpose2d", "nn.functional.conv_transpose3d", "cumsum",
    "floor_divide", "remainder", "fmod", "trunc", "frac", "sign", "bitwise_and", "bitwise_or", "bitwise_xor",
    "bitwise_not", "bitwise_left_shift", "bitwise_right_shift", "logical_xor", "__getitem__",
    "nn.functional.scaled_dot_product_attention",
    "roll", "flip", "fliplr", "flipud", "tril", "triu", "diagonal", "movedim", "nn.functional.pixel_shuffle",
    "nn.functional.pixel_unshuffle", "tensor_split", "nn.functional.one_hot", "square", "log2", "log10", "exp2",
    "logit", "nn.functional.logsigmoid", "nn.functional.selu", "nn.functional.celu", "nn.functional.softsign",
    "nn.functional.tanhshrink", "nn.functional.hardshrink", "nn.functional.softshrink", "nn.functional.threshold",
    "nn.functional.prelu", "nn.functional.rrelu", "isnan", "isinf", "isfinite", "isposinf", "isneginf", "nan_to_num",
    "addcmul", "addcdiv", "lerp", "hypot", "logaddexp", "xlogy", "fmax", "fmin", "logsumexp", "var_mean", "std_mean",
    "any", "all", "count_nonzero", "nn.functional.softmin", "nn.functional.normalize",
    "nn.functional.cosine_similarity", "nn.functional.pairwise_distance", "outer", "nn.functional.mse_loss",
    "nn.functional.l1_loss", "nn.functional.smooth_l1_loss", "nn.functional.huber_loss",
    "nn.functional.binary_cross_entropy_with_logits", "nn.functional.binary_cross_entropy", "nn.functional.kl_div",
    "nn.functional.nll_loss", "nn.functional.cross_entropy", "baddbmm", "linalg.norm", "cdist",
    "tan", "sinh", "cosh", "asin", "acos", "atan", "atan2", "asinh", "acosh", "atanh", "sinc", "deg2rad", "rad2deg",
    "copysign", "signbit", "dot", "vdot", "inner", "mv", "addmv", "addbmm", "tensordot", "trace", "linalg.multi_dot",
    "kron", "repeat_interleave", "tile", "take_along_dim", "unfold", "diff", "cross", "linalg.cross", "topk", "sort",
    "argsort", "msort", "kthvalue", "median", "prod", "cumprod", "cummax", "cummin", "logcumsumexp",
    "nansum", "nanmean", "clamp_min", "clamp_max", "aminmax", "erfc",
    "scatter", "scatter_add", "scatter_reduce", "index_put", "index_add", "index_copy", "index_fill", "index_reduce",
    "masked_scatter", "meshgrid", "searchsorted", "bucketize", "diagonal_scatter", "slice_scatter", "select_scatter",
]  # instance_norm's samples mostly update running statistics in place (refused by design; tests/frontend/test_ops)
MIN_SUPPORTED = 0.5  # fraction of an op's samples that must compile
# norms of order 1, 2 and inf are lowered; most samples ask for others (0, 3, -inf, "nuc"), refused with the reason
MIN_SUPPORTED_OF = {"norm": 0.2, "linalg.vector_norm": 0.2}


# one lowering each, several index maps or weight tables: pad's modes, interpolate's modes
EVERY_VARIANT = {"nn.functional.pad", "nn.functional.interpolate", "div", "scatter_reduce", "index_reduce", "meshgrid"}
SAMPLE_DTYPE = {name: torch.int64 for name in ("bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not",
                                               "bitwise_left_shift", "bitwise_right_shift", "nn.functional.one_hot")}
# else float32


# ops whose numbers are random: ours are not eager's (tests/frontend/test_ops_random.py checks their statistics)
RANDOM = {"nn.functional.dropout"}


def _same_where_both_kept(actual, expected):
    """A dropout's output against eager's: the same shape and dtype, and equal wherever both kept the element."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    both = (actual != 0) & (expected != 0)
    assert_close(actual[both], expected[both])


def _same_shape_and_dtype(actual, expected):
    """Attention with dropout against eager's: its probabilities are dropped at random, so only the kind of result
    compares (tests/frontend/test_ops_attention.py checks the dropped and kept probabilities)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype and torch.isfinite(actual).all()


def _opinfos():
    by_name = {}
    for info in op_db:
        key = (info.name, info.variant_test_name if info.name in EVERY_VARIANT else "")
        if info.name in OPS and key not in by_name:
            by_name[key] = info
    return [info for n in OPS for key, info in by_name.items() if key[0] == n]


def _id(info) -> str:
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


def _as_function(info, sample):
    """A function of the sample's tensors; every other argument is fixed."""
    seq = isinstance(sample.input, (list, tuple))  # cat and einsum take a sequence first
    first = list(sample.input) if seq else [sample.input]
    leaves = [*first, *sample.args]
    tensor_pos = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor)]

    def call(*tensors):
        filled = list(leaves)
        for pos, t in zip(tensor_pos, tensors):
            filled[pos] = t
        head, rest = (filled[: len(first)], filled[len(first):]) if seq else (filled[0], filled[1:])
        return info.op(head, *rest, **sample.kwargs)

    return call, [leaves[i] for i in tensor_pos]


def run_samples(info, dtype: torch.dtype, target: str, check) -> tuple[int, int]:
    """Each of the op's samples compiled for `target`: it gives eager's answer (check(actual, expected) per output)
    or is refused with a StitchflowError; zero-size samples are refused with that error. Returns (compiled,
    counted)."""
    supported = total = 0
    for sample in info.sample_inputs("cpu", dtype):
        fn, tensors = _as_function(info, sample)
        if any(t.dim() == 0 and t.requires_grad for t in tensors):
            continue
        try:
            expected = fn(*tensors)
        except Exception:
            continue
        outs = [expected] if isinstance(expected, torch.Tensor) else list(expected)
        if not all(isinstance(o, torch.Tensor) for o in outs):
            continue
        if any(t.numel() == 0 for t in [*tensors, *outs]):
            with pytest.raises(stitchflow.StitchflowError, match="zero-size|empty"):
                stitchflow.compile(fn, tensors, target=target)(*tensors)
            continue  # zero-size tensors are refused by design, with that error
        total += 1
        try:
            prog = stitchflow.compile(fn, tensors, target=target)
        except stitchflow.StitchflowError:
            continue
        actual = prog(*tensors)
        sample_check = _same_shape_and_dtype if sample.kwargs.get("dropout_p") else check  # random: not eager's
        for a, e in zip([actual] if isinstance(expected, torch.Tensor) else actual, outs):
            sample_check(a, e)
        supported += 1
    assert total > 0
    return supported, total


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("info", _opinfos(), ids=_id)
def test_opinfo_samples(info, target):
    """On the reference target most samples of each op must compile; on the gpu target (generated Triton
    kernels, on CPU tensors under the interpreter) the same samples must give eager's answer or a refusal."""
    if target == "gpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the gpu target runs on CPU tensors only under TRITON_INTERPRET=1")
    check = _same_where_both_kept if info.name in RANDOM else assert_close
    supported, total = run_samples(info, SAMPLE_DTYPE.get(info.name, torch.float32), target, check)
    if target == "gpu":
        return  # what the reference target supports is counted there
    wanted = MIN_SUPPORTED_OF.get(info.name, MIN_SUPPORTED)
    assert supported / total >= wanted, f"{info.name}: only {supported}/{total} samples supported"
