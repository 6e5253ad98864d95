"""Elementary functions of complex values (frontend/ops_complex_math.py) against eager on the reference and gpu
targets, at random points and at the awkward ones (zero, the negative real axis with either zero's sign, large real
and imaginary parts); and two models that use them, trained through the backend with no fallback: an S4D layer
(its kernel from a complex diagonal state matrix, a long convolution by FFT) and a complex-valued MLP."""

import math

import pytest
import torch

import stitchflow
from stitchflow import backend
from conftest import assert_close, skip_unless_kernels_run, twins

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

FUNCTIONS = {
    "log": torch.log, "log2": torch.log2, "log10": torch.log10, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "reciprocal": torch.reciprocal, "square": torch.square, "sin": torch.sin, "cos": torch.cos, "tan": torch.tan,
    "sinh": torch.sinh, "cosh": torch.cosh, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sgn": torch.sgn,
    "pow_0": lambda z: z ** 0, "pow_3": lambda z: z ** 3, "pow_real": lambda z: z ** 1.7,
    "pow_half": lambda z: torch.pow(z, -0.5), "pow_complex": lambda z: z ** (0.5 + 1j),
    "pow_tensor": lambda z: torch.pow(z, z * 0.1), "power_of_two": lambda z: 2 ** z, "exp2": torch.exp2,
    "expm1": torch.expm1, "log1p": torch.log1p, "asin": torch.asin, "acos": torch.acos, "atan": torch.atan,
    "asinh": torch.asinh, "acosh": torch.acosh, "atanh": torch.atanh, "sinc": torch.sinc,
    "prod": lambda z: torch.prod(z * 0.5, -1, keepdim=True), "cumprod": lambda z: torch.cumprod(z * 0.5, -1),
}
AWKWARD = [0j, complex(-4, 0.0), complex(-4, -0.0), complex(3, 0), complex(0, -2), complex(30, 1), complex(-25, 2),
           complex(1, 30), complex(-0.5, -40)]


def _points(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.complex(torch.randn(rows, 9, generator=g) * 2, torch.randn(rows, 9, generator=g) * 2)
    z[0] = torch.tensor(AWKWARD)
    return torch.view_as_real(z).contiguous()


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_complex_functions_equal_eager(name, target):
    skip_unless_kernels_run(target)
    fn = lambda x: torch.view_as_real(FUNCTIONS[name](torch.view_as_complex(x)))  # noqa: E731
    x = _points(3, len(name)).to(DEVICE if target == "gpu" else "cpu")
    prog = stitchflow.compile(fn, (x,), target=target)
    out, ref = prog(x).cpu(), fn(x).cpu()
    # overflow is where eager's libm and these formulas may part (inf against a large finite value)
    finite = torch.isfinite(ref).all(-1, keepdim=True).expand_as(ref)
    torch.testing.assert_close(out[finite], ref[finite], rtol=2e-5, atol=2e-5)
    # (past overflow, a quotient of infinities is NaN here where torch's complex division scales first)
    assert torch.equal(out[~finite].isnan(), ref[~finite].isnan()) or name.startswith("pow") or name == "sinc"


class S4D(torch.nn.Module):
    """A diagonal state-space layer (Gu et al.'s S4D): the convolution kernel K = 2·Re(Σ_n C_n (e^(dt·A_n) - 1) / A_n
    · e^(dt·A_n·l)) from complex A and C, applied by FFT over twice the length."""

    def __init__(self, channels: int = 4, state: int = 8):
        super().__init__()
        self.log_dt = torch.nn.Parameter(torch.rand(channels) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
        self.c = torch.nn.Parameter(torch.view_as_real(torch.randn(channels, state // 2, dtype=torch.cfloat)))
        self.log_a_real = torch.nn.Parameter(torch.log(0.5 * torch.ones(channels, state // 2)))
        self.a_imag = torch.nn.Parameter(math.pi * torch.arange(state // 2).float().repeat(channels, 1))
        self.d = torch.nn.Parameter(torch.randn(channels))

    def forward(self, u):  # (batch, channels, length)
        length = u.shape[-1]
        dt = torch.exp(self.log_dt)
        a = -torch.exp(self.log_a_real) + 1j * self.a_imag
        dt_a = a * dt.unsqueeze(-1)
        c = torch.view_as_complex(self.c) * (torch.exp(dt_a) - 1.0) / a
        k = 2 * torch.einsum("hn,hnl->hl", c, torch.exp(dt_a.unsqueeze(-1) * torch.arange(length))).real
        y = torch.fft.irfft(torch.fft.rfft(u, n=2 * length) * torch.fft.rfft(k, n=2 * length), n=2 * length)
        return torch.nn.functional.gelu(y[..., :length] + u * self.d.unsqueeze(-1))


class ComplexMLP(torch.nn.Module):
    """Pairs of features as complex numbers through a complex weight, tanh and a square root, back to magnitudes."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.w = torch.nn.Parameter(torch.view_as_real(torch.randn(width, width, dtype=torch.cfloat) / width))

    def forward(self, x):
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        h = torch.tanh(z @ torch.view_as_complex(self.w))
        return (torch.sqrt(h + 2) * torch.log(h.abs() + 1)).abs() + torch.sigmoid(h).real


@pytest.mark.parametrize("model, shape", [(S4D, (2, 4, 24)), (ComplexMLP, (3, 5, 16))], ids=["s4d", "complex_mlp"])
def test_models_with_complex_functions_train_whole(model, shape, fresh_dynamo):
    ours, theirs = twins(model)
    x = torch.randn(shape)
    out, ref = torch.compile(ours, backend="stitchflow")(x), theirs(x)
    assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5 * q.grad.abs().max().item(), msg=name)
    assert not backend.FALLBACKS, backend.fallback_report()
