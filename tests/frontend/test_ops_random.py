"""Random ops (dropout, rand, randn, bernoulli): counter-based numbers, the same on every target.

Their numbers are not eager's, so they are checked by what must hold: Philox's numbers bit for bit against Triton's
own `tl.rand` (under the interpreter), the rates and scales of dropout, the moments of rand and randn, one mask
shared by a dropout's output and its gradient, fresh numbers at every call and the same ones after
torch.manual_seed, and the reference target and the gpu target's kernels drawing the same numbers."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stitchflow
from conftest import skip_unless_kernels_run
from stitchflow import backend
from stitchflow.ir import random
from stitchflow.ir.errors import StitchflowError

TARGETS = ["reference", "gpu"]


def _device(target: str) -> str:
    """Where a target's tensors live: the gpu target's on CUDA where there is a GPU (else the interpreter's CPU)."""
    return "cuda" if target == "gpu" and torch.cuda.is_available() else "cpu"


def test_philox_equals_tritons_own_generator():
    skip_unless_kernels_run("gpu")
    import triton
    import triton.language as tl

    @triton.jit
    def draw(seed_ptr, uniform, normal, n: tl.constexpr):
        seed, offset = tl.load(seed_ptr), tl.arange(0, n)
        tl.store(uniform + offset, tl.rand(seed, offset))
        tl.store(normal + offset, tl.randn(seed, offset))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for value in (0, 12345, (1 << 40) + 7, (1 << 62) - 3):
        seed = torch.tensor(value, dtype=torch.int64, device=device)
        uniform, normal = torch.empty(1024, device=device), torch.empty(1024, device=device)
        draw[(1,)](seed, uniform, normal, n=1024)
        offsets = torch.arange(1024, device=device)
        assert torch.equal(uniform, random.uniform(seed, offsets))  # integer rounds, one exact conversion
        torch.testing.assert_close(normal, random.normal(seed, offsets), rtol=1e-5, atol=1e-5)


def test_uniform_and_normal_numbers_have_their_moments():
    u, n = random.uniform(7, torch.arange(1 << 16)), random.normal(7, torch.arange(1 << 16))
    assert u.dtype == n.dtype == torch.float32 and 0 <= u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.005
    assert abs(n.mean()) < 0.02 and abs(n.std() - 1) < 0.02
    assert not torch.equal(random.uniform(8, torch.arange(64)), random.uniform(7, torch.arange(64)))


def _dropout(x):
    return F.dropout(x, 0.3, training=True) * 2


@pytest.mark.parametrize("target", TARGETS)
def test_dropout_keeps_its_rate_and_scale_and_draws_anew_each_call(target):
    skip_unless_kernels_run(target)
    x = torch.ones(300, 200, device=_device(target))
    with torch.no_grad():
        prog = stitchflow.compile(_dropout, (x,), target=target)
        first, second = prog(x), prog(x)
    kept = first != 0
    assert abs(kept.float().mean().item() - 0.7) < 0.01
    assert torch.allclose(first[kept], torch.tensor(2 / 0.7, device=x.device))
    assert not torch.equal(first, second)


def test_a_seeded_run_repeats_and_both_targets_draw_the_same_numbers(monkeypatch):
    skip_unless_kernels_run("gpu")
    outs = []
    with torch.no_grad():
        for target in TARGETS:
            x = torch.randn(37, 53, generator=torch.Generator().manual_seed(0)).to(_device(target))
            prog = stitchflow.compile(_dropout, (x,), target=target)
            torch.manual_seed(3)
            first = prog(x)
            torch.manual_seed(3)
            assert torch.equal(prog(x), first)
            # the same seed on both targets (torch's CPU and CUDA generators would draw different ones)
            monkeypatch.setattr(prog, "random_seed", lambda inputs: torch.tensor(1234, device=x.device))
            outs.append(prog(x).cpu())
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("target", TARGETS)
def test_rand_randn_and_bernoulli_in_a_graph(target):
    skip_unless_kernels_run(target)

    def noisy(x):
        return x + torch.randn_like(x) * 0.5, torch.rand(x.shape[0], 4, device=x.device), \
            torch.bernoulli(torch.full_like(x, 0.25))

    x = torch.zeros(256, 64, device=_device(target))
    with torch.no_grad():
        normal, uniform, coins = stitchflow.compile(noisy, (x,), target=target)(x)
    assert abs(normal.std().item() - 0.5) < 0.02 and uniform.shape == (256, 4) and 0 <= uniform.min()
    assert set(coins.unique().tolist()) == {0.0, 1.0} and abs(coins.mean().item() - 0.25) < 0.02


@pytest.mark.parametrize("target", TARGETS)
def test_training_through_dropout_takes_the_forwards_mask(target, fresh_dynamo):
    """AOTAutograd's native_dropout hands its mask to the backward: the gradient is the upstream gradient through
    exactly the elements the forward kept, scaled as they were."""
    skip_unless_kernels_run(target)
    torch.manual_seed(0)
    w = torch.rand(64, 32, device=_device(target)).add(0.1).requires_grad_()
    x = torch.rand(64, 32, device=_device(target)).add(0.1)
    compiled = torch.compile(lambda x, w: F.dropout(x * w, 0.25, training=True).tanh(), backend="stitchflow",
                             options={"target": target})
    y = compiled(x, w)
    upstream = torch.randn_like(y)
    y.backward(upstream)
    kept = y != 0
    torch.testing.assert_close(w.grad, upstream * (1 - y * y) * kept / 0.75 * x)
    assert 0.7 < kept.float().mean().item() < 0.8
    assert backend.FALLBACKS == [], backend.fallback_report()


def test_a_model_with_dropout_trains_with_nothing_left_to_eager(fresh_dynamo):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.2), nn.GELU(), nn.Linear(64, 16), nn.Dropout(0.1))
    compiled = torch.compile(model, backend="stitchflow")
    for _ in range(2):
        compiled(torch.randn(8, 16)).square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert backend.FALLBACKS == [], backend.fallback_report()


def test_a_program_with_random_numbers_refuses_a_gradient_by_eager_rerun():
    prog = stitchflow.compile(lambda x: x * torch.rand(x.shape[0]), (torch.randn(8),))
    with pytest.raises(StitchflowError, match="draws random numbers"):
        prog(torch.randn(8, requires_grad=True))


@pytest.mark.parametrize("target", TARGETS)
def test_channel_dropout_drops_whole_channels(target):
    skip_unless_kernels_run(target)
    x = torch.ones(64, 32, 5, 7, device=_device(target))
    with torch.no_grad():
        y = stitchflow.compile(lambda x: F.dropout2d(x, 0.4, training=True), (x,), target=target)(x)
    per_channel = y.flatten(2)
    assert torch.equal(per_channel.amax(-1), per_channel.amin(-1))  # one number per (sample, channel)
    kept = per_channel[..., 0] != 0
    assert abs(kept.float().mean().item() - 0.6) < 0.05
    assert torch.allclose(per_channel[kept], torch.tensor(1 / 0.6, device=x.device))


def test_explain_names_the_seed_the_program_draws():
    with torch.no_grad():
        prog = stitchflow.compile(_dropout, (torch.randn(4, 6),))
    assert "random_seed: drawn from torch's generator at every call" in prog.explain()


@pytest.mark.parametrize("target", TARGETS)
def test_sampling_ops_draw_from_their_distributions(target):
    """multinomial by Gumbel-max (with and without replacement), randint in its range, randperm a permutation."""
    skip_unless_kernels_run(target)
    weights = torch.tensor([[1.0, 2.0, 3.0, 0.0, 4.0]], device=_device(target)).repeat(4000, 1)

    def sample(w):
        return (torch.multinomial(w, 1), torch.multinomial(w, 3), torch.multinomial(w, 6, replacement=True),
                torch.randint(3, 10, (w.shape[0], 7), device=w.device), torch.randperm(w.shape[0] // 4, device=w.device))

    with torch.no_grad():
        one, three, six, ints, order = (t.cpu() for t in stitchflow.compile(sample, (weights,), target=target)(weights))
    expected = torch.tensor([0.1, 0.2, 0.3, 0.0, 0.4])
    for drawn in (one, six):
        frequencies = torch.bincount(drawn.flatten(), minlength=5).float() / drawn.numel()
        assert (frequencies - expected).abs().max() < 0.025 and frequencies[3] == 0
    assert three.shape == (4000, 3) and (three != 3).all()
    assert all((three[:, a] != three[:, b]).all() for a, b in ((0, 1), (0, 2), (1, 2)))  # without replacement
    assert ints.dtype == torch.int64 and ints.min() == 3 and ints.max() == 9
    assert torch.equal(order.sort().values, torch.arange(1000))


def test_a_randint_range_past_float32s_resolution_is_refused():
    with pytest.raises(StitchflowError, match="range of"):
        stitchflow.compile(lambda x: x + torch.randint(0, 1 << 30, (x.shape[0],)), (torch.randn(4),))
