"""Layouts across a training step's graphs on the gpu target: the gradients that the backward's
partitions hand to cuDNN's convolution backwards leave channels last, as the forward's convolutions
ran, so cuDNN transposes nothing around its kernels."""

import copy

import pytest
import torch
import torch.nn as nn

import stitchflow.backend_layouts as backend_layouts
from conftest import TOL, skip_unless_kernels_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class _ResBlock(nn.Module):
    """U-Net's residual block: group norm, SiLU and a 3x3 convolution twice, a 1x1 skip."""

    def __init__(self, cin: int, cout: int, groups: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(groups, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1)

    def forward(self, x):
        h = self.conv1(nn.functional.silu(self.norm1(x)))
        return self.conv2(nn.functional.silu(self.norm2(h))) + self.skip(x)


def _layouts_at_convolution_backwards(monkeypatch) -> list:
    """(the gradient's layout, the input's) at each convolution backward, recorded where the backward
    graph puts its operands in one layout (`like_gradient` runs just before each)."""
    seen, like = [], backend_layouts.like_gradient

    def recorded(x, grad):
        seen.append((_layout(grad), _layout(x)))
        return like(x, grad)

    monkeypatch.setattr(backend_layouts, "like_gradient", recorded)
    monkeypatch.setattr(backend_layouts, "LAYOUT_FREE", backend_layouts.LAYOUT_FREE | {recorded})
    monkeypatch.setattr(backend_layouts, "CONVOLUTION_READERS", backend_layouts.CONVOLUTION_READERS | {recorded})
    return seen


def _layout(t: torch.Tensor) -> str:
    if t.is_contiguous():
        return "nchw"
    return "last" if t.is_contiguous(memory_format=torch.channels_last) else "other"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_convolution_backwards_get_channels_last_gradients(dtype, monkeypatch, fp32_convolutions):
    """A stem, two residual blocks (group norms whose gradients are computed per group and returned as
    views) and an output convolution: every convolution backward but the last layer's (whose gradient is
    the caller's, NCHW) gets its output's gradient channels last, and the gradients are eager's."""
    skip_unless_kernels_run("gpu")
    seen = _layouts_at_convolution_backwards(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), _ResBlock(8, 16, 4), _ResBlock(16, 16, 4),
                          nn.GroupNorm(4, 16), nn.SiLU(), nn.Conv2d(16, 3, 3, padding=1)).to(DEVICE, dtype)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 10, device=DEVICE, dtype=dtype)
    # no CUDA graphs: a replayer's warm-up and timing calls would run the backward's eager ops more than once a step
    compiled = torch.compile(model, backend="stitchflow", options={"target": "gpu", "cuda_graphs": False})
    for _ in range(2):
        seen.clear()
        xs = [x.clone().requires_grad_() for _ in range(2)]
        for m, xi in zip((compiled, reference), xs):
            m.zero_grad()
            m(xi).square().mean().backward()
        tol = TOL[dtype] if dtype != torch.bfloat16 else dict(rtol=0.05, atol=0.05)
        torch.testing.assert_close(xs[0].grad, xs[1].grad, **tol)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **tol)
    assert len(seen) == 8, seen
    assert seen[0][0] == "nchw", seen  # the output layer: the caller's gradient
    assert all(grad == "last" for grad, _ in seen[1:]), seen


def test_convolution_gradients_reach_autograd_in_their_variables_layout(monkeypatch, fp32_convolutions):
    """The weight gradients that the backward returns straight from cuDNN pass through one `like_parameters`
    launch into the NCHW layout of their parameters, so autograd keeps them as they are: every gradient is
    contiguous and eager's; a 1x1 weight's (a GEMM's), the biases' (sums) and the image's do not pass."""
    skip_unless_kernels_run("gpu")
    import stitchflow.training as training

    passed, laid = [], training.gradients_like_parameters
    monkeypatch.setattr(training, "gradients_like_parameters", lambda bw, primals: passed.append(laid(bw, primals)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), _ResBlock(8, 16, 4), nn.Conv2d(16, 3, 3)).to(DEVICE)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 10, device=DEVICE)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    for m, xi in zip((torch.compile(model, backend="stitchflow", options={"target": "gpu"}), reference), xs):
        m(xi).square().mean().backward()
    assert passed == [4]  # the four 3x3 weights
    for ours, eager in [(xs[0].grad, xs[1].grad), *((p.grad, q.grad) for p, q in
                                                     zip(model.parameters(), reference.parameters()))]:
        assert ours.is_contiguous()
        torch.testing.assert_close(ours, eager, **TOL[torch.float32])
