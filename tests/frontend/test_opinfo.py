"""PyTorch's OpInfo samples for the ops stitchflow supports: each sample either compiles and
equals eager, or is refused with a StitchflowError that names the problem. Never a wrong
answer, never an unexplained crash; and most samples of each op must be supported."""

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
]  # instance_norm's samples mostly update running statistics in place (refused by design; tests/frontend/test_ops)
MIN_SUPPORTED = 0.5  # fraction of an op's samples that must compile
# norms of order 1, 2 and inf are lowered; most samples ask for others (0, 3, -inf, "nuc"), refused with the reason
MIN_SUPPORTED_OF = {"norm": 0.2, "linalg.vector_norm": 0.2}


# one lowering each, several index maps or weight tables: pad's modes, interpolate's modes
EVERY_VARIANT = {"nn.functional.pad", "nn.functional.interpolate"}


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


@pytest.mark.parametrize("info", _opinfos(), ids=_id)
def test_opinfo_samples(info):
    supported = total = 0
    for sample in info.sample_inputs("cpu", torch.float32):
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
                stitchflow.compile(fn, tensors)(*tensors)
            continue  # zero-size tensors are refused by design, with that error
        total += 1
        try:
            prog = stitchflow.compile(fn, tensors)
        except stitchflow.StitchflowError:
            continue
        actual = prog(*tensors)
        for a, e in zip([actual] if isinstance(expected, torch.Tensor) else actual, outs):
            assert_close(a, e)
        supported += 1
    assert total > 0
    wanted = MIN_SUPPORTED_OF.get(info.name, MIN_SUPPORTED)
    assert supported / total >= wanted, f"{info.name}: only {supported}/{total} samples supported"
