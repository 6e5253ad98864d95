"""PyTorch's OpInfo samples in complex64 for the ops stitchflow lowers on complex values (ops_complex.py,
ops_complex_math.py, ops_fft.py): complex inputs enter as view_as_real pairs, and each sample compiles and equals
eager or is refused with a StitchflowError that names the problem; most samples of each op compile (counted on the
reference target)."""

import os

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

from test_opinfo import run_samples

COMPLEX_OPS = [
    "add", "sub", "mul", "div", "neg", "pow", "square", "reciprocal", "exp", "exp2", "expm1", "log", "log2", "log10",
    "log1p", "sqrt", "rsqrt", "sin", "cos", "tan", "sinh", "cosh", "tanh", "asin", "acos", "atan", "asinh", "acosh",
    "atanh", "sigmoid", "sgn", "abs", "angle", "conj", "conj_physical", "resolve_conj", "real", "imag",
    "view_as_real", "view_as_complex", "polar", "complex", "isnan", "isfinite", "nan_to_num", "sum", "mean", "prod",
    "cumsum", "cumprod", "linalg.vector_norm", "matmul", "mm", "bmm", "addmm", "addmv", "baddbmm", "einsum", "dot",
    "vdot", "inner", "outer", "mv", "kron", "tensordot", "transpose", "permute", "reshape", "view", "expand",
    "flatten", "squeeze", "unsqueeze", "movedim", "t", "cat", "stack", "chunk", "split", "unbind", "tensor_split",
    "narrow", "select", "flip", "fliplr", "flipud", "roll", "diagonal", "tril", "triu", "tile", "repeat", "unfold",
    "diff", "where", "masked_fill", "index_select", "gather", "take_along_dim", "index_put", "index_add",
    "index_copy", "scatter", "scatter_add", "clone", "contiguous", "zeros_like", "ones_like", "full_like", "fft.fft",
    "fft.ifft", "fft.irfft", "fft.fft2", "fft.ifft2", "fft.fftn", "fft.ifftn", "fft.fftshift", "fft.ifftshift",
]
MIN_SUPPORTED = 0.5
REAL_INPUTS = {"polar", "complex", "view_as_complex"}  # ops that make complex values of real tensors
TOL = dict(rtol=1e-4, atol=1e-5)


def _opinfos():
    first = {}
    for info in op_db:
        if info.name in COMPLEX_OPS and info.name not in first:
            first[info.name] = info
    return [first[name] for name in COMPLEX_OPS if name in first]


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("info", _opinfos(), ids=lambda info: info.name)
def test_complex_opinfo_samples(info, target):
    if target == "gpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the gpu target runs on CPU tensors only under TRITON_INTERPRET=1")
    dtype = torch.float32 if info.name in REAL_INPUTS else torch.complex64
    supported, total = run_samples(info, dtype, target, lambda a, e: torch.testing.assert_close(a, e, **TOL,
                                                                                               equal_nan=True))
    if target == "reference":
        assert supported / total >= MIN_SUPPORTED, f"{info.name}: only {supported}/{total} samples supported"
