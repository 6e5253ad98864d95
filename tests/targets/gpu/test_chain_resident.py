"""The persistent chain kernel, the TMA GEMM and the polynomial GELU, under the Triton interpreter."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from stitchflow.targets.gpu import chain_cost, chain_plans
from stitchflow.targets.gpu.chain_kernels import Epilogue, GemmTiles, _normal_cdf
from stitchflow.targets.gpu.chain_resident import ResidentTiles, resident_chain, resident_refusal
from stitchflow.targets.gpu.gemm_tma import gemm_tma, tma_refusal

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests on CPU tensors (forcing the interpreter here would switch "
                                "a GPU session's other tests to it too)")

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def rand(*shape, dtype, scale=1.0, seed=[100]):
    seed[0] += 1
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed[0])) * scale).to(dtype)


@triton.jit
def _cdf_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _normal_cdf(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def test_normal_cdf_polynomial_is_fp32_accurate():
    x = torch.linspace(-14, 14, 40001)
    out = torch.empty_like(x)
    _cdf_kernel[(triton.cdiv(x.numel(), 4096),)](x, out, x.numel(), BLOCK=4096)
    ref = torch.special.ndtr(x.double())
    assert (out.double() - ref).abs().max().item() < 1.5e-7
    assert torch.all(out[x < -9] < 1e-18)  # the negative tail keeps its relative size, no cancellation


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("gated,tiles", [
    (False, ResidentTiles(bm=16, bn=32, num_warps=4)),
    (True, ResidentTiles(bm=32, bn=32, num_warps=4, prefetch=False)),
    (False, ResidentTiles(bm=16, bn=128, num_warps=4, weights_in_registers=True)),
])
def test_resident_chain_odd_shapes(dtype, gated, tiles):
    M, K, N, L = 101, 45, 70, 19  # odd everywhere; 4 programs under the interpreter walk 2-7 tiles each
    a, b, bu = rand(M, K, dtype=dtype), rand(K, N, dtype=dtype, scale=K ** -0.5), rand(K, N, dtype=dtype, scale=0.2)
    d, b1, b2 = rand(N, L, dtype=dtype, scale=N ** -0.5), rand(N, dtype=dtype), rand(L, dtype=dtype)
    res = rand(M, L, dtype=dtype)
    act = "silu" if gated else "gelu"
    out, stat = resident_chain(a, b, d, act=act, bias1=b1, bu=bu if gated else None, bias2=b2, residual=res,
                               epi2=Epilogue(bias=True, residual=True, rowstat="sum"), tiles=tiles, exact_fp32=True)
    A, B, D = a.double(), b.double(), d.double()
    h = (F.silu if gated else F.gelu)(A @ B + b1.double()).to(dtype).double()
    if gated:
        h = (h * (A @ bu.double()).to(dtype).double()).to(dtype).double()
    ref = h @ D + b2.double() + res.double()
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(stat, out.double().sum(1)) < 1e-5


def test_resident_transposed_and_refusals():
    a, b = rand(77, 64, dtype=torch.bfloat16), rand(64, 96, dtype=torch.bfloat16, scale=0.125)
    d = rand(96, 32, dtype=torch.bfloat16, scale=0.1)
    out, _ = resident_chain(a, b, d, act="relu", tiles=ResidentTiles(bm=16, num_warps=4, transposed=True))
    ref = torch.relu(a.double() @ b.double()).to(torch.bfloat16).double() @ d.double()
    assert rel_err(out, ref) < 1e-2
    assert "K=256" in resident_refusal(256, 64, 64)
    assert "N <= 256" in resident_refusal(64, 512, 64, ResidentTiles(transposed=True))
    with pytest.raises(ValueError, match="16-bit"):
        resident_chain(a.float(), b.float(), d.float(), tiles=ResidentTiles(bm=16, transposed=True))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_tma_gemm_gated_and_split(dtype):
    a, b, bu = rand(37, 128, dtype=dtype), rand(128, 48, dtype=dtype, scale=0.1), rand(128, 48, dtype=dtype, scale=0.1)
    bias, r = rand(48, dtype=dtype), rand(37, 48, dtype=dtype)
    out, _ = gemm_tma(a, b, epi=Epilogue(0.5, True, "gelu", True), bias=bias, residual=r, exact_fp32=True,
                      tiles=GemmTiles(16, 16, 32, split_k=2))
    ref = F.gelu(0.5 * (a.double() @ b.double()) + bias.double()) + r.double()
    assert rel_err(out, ref) < TOL[dtype]
    out, _ = gemm_tma(a, b, bu=bu, epi=Epilogue(act="silu"), exact_fp32=True, tiles=GemmTiles(16, 16, 32))
    assert rel_err(out, F.silu(a.double() @ b.double()) * (a.double() @ bu.double())) < TOL[dtype]
    assert "multiple" in tma_refusal(a[:, :100], b[:100], GemmTiles(16, 16, 32))


def test_resident_plans_are_ranked_for_memory_bound_chains():
    profile = chain_cost.profile_for("NVIDIA H200", 4.25e12, 7.8e14)
    shape = chain_cost.ChainShape(65536, 64, 256, 64)
    plans = chain_plans.resident_plans(shape, profile)
    assert plans and all(p.estimate.seconds > shape.flops / profile.mma_flops for p in plans)
    assert not chain_plans.resident_plans(chain_cost.ChainShape(128, 4096, 16384, 4096), profile)  # K too large
    assert {"resident", "fused", "library"} <= {p.kind for p in chain_plans.shortlist(shape, profile, 8)}
