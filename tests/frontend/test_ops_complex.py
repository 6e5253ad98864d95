"""Complex values as pairs of real tensors (frontend/ops_complex.py) beyond the Fourier transforms: rotary
embeddings written with complex numbers (Meta's Llama and torchtitan: view_as_complex of the query's pairs times
polar frequencies, view_as_real back), torch.polar and torch.complex, magnitudes; against eager on the reference and
gpu targets and through the backend, forward and backward, with no fallback."""

import pytest
import torch

import stitchflow
from stitchflow import backend
from conftest import assert_close, skip_unless_kernels_run, twins


def frequencies(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x (batch, seq, heads, head_dim) rotated pairwise by complex frequencies (seq, head_dim // 2)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = torch.view_as_real(pairs * freqs.view(1, pairs.shape[1], 1, pairs.shape[-1])).flatten(3)
    return rotated.type_as(x)


class RotaryAttention(torch.nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, seq: int = 12):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.register_buffer("freqs", frequencies(dim // heads, seq))  # a complex buffer

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, -1) for t in self.qkv(x).chunk(3, dim=-1))
        q, k = rotary(q, self.freqs[:s]), rotary(k, self.freqs[:s])
        o = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return o.transpose(1, 2).reshape(b, s, d)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_rotary_embeddings_with_complex_frequencies_compile_whole(train, fresh_dynamo):
    ours, theirs = twins(RotaryAttention)
    x = torch.randn(2, 12, 32)
    with torch.set_grad_enabled(train):
        out, ref = torch.compile(ours, backend="stitchflow")(x), theirs(x)
    assert_close(out, ref)
    if train:
        out.square().sum().backward()
        ref.square().sum().backward()
        assert_close(ours.qkv.weight.grad, theirs.qkv.weight.grad)
    assert not backend.FALLBACKS, backend.fallback_report()


CASES = {
    "polar_products": lambda x: torch.view_as_real(torch.polar(x.abs() + 1, x) * torch.polar(torch.ones_like(x),
                                                                                             2 * x)).sum(-1),
    "complex_magnitude": lambda x: torch.complex(x, x.flip(0) * 3).abs(),
    "rotary": lambda x: rotary(x, frequencies(x.shape[-1], x.shape[1])),
    "exp_of_i_theta": lambda x: torch.view_as_real(torch.exp(1j * x) / (x.abs() + 1) - torch.exp(torch.complex(
        x, x.flip(-1)))),
    "phase": lambda x: torch.angle(torch.complex(x, x.flip(0))) + torch.angle(x) + torch.angle(torch.fft.fft(x, dim=1)),
    "quotient_and_negation": lambda x: torch.view_as_real(-torch.complex(x, x + 1) / torch.complex(x.abs() + 1, x)),
}


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_complex_arithmetic_equals_eager(name, target):
    skip_unless_kernels_run(target)
    g = torch.Generator().manual_seed(len(name))
    example, x = (torch.randn(2, 6, 3, 8, generator=g) for _ in range(2))
    prog = stitchflow.compile(CASES[name], (example,), target=target, fusion="auto")
    assert_close(prog(x), CASES[name](x))
