"""Plans whose GEMM1 runs in the vendor library (cuBLAS, cuDNN's conv) with our fused activation
pass or activation-on-load GEMM2, conv chains, and the cost model's pricing of them; on the CPU
under the Triton interpreter."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest
import torch
import torch.nn.functional as F

from stitchflow.targets.gpu import chain_cost, chain_kernels as ck, chain_plans
from stitchflow.targets.gpu.chains import Operands, conv_operands, im2col_nhwc, run_plan

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests on CPU tensors (forcing the interpreter here would switch "
                                "a GPU session's other tests to it too)")

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
DTYPES = (torch.float32, torch.bfloat16)
H200 = chain_cost.profile_for("NVIDIA H200", 4.25e12, 800e12)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def rand(*shape, dtype, scale=1.0, seed=[300]):
    seed[0] += 1
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed[0])) * scale).to(dtype)


def plan(kind, **tiles):
    return chain_cost.Plan(kind, "", (), **tiles)


LIBRARY_PLANS = [plan("cublas_epi"), plan("cublas_pro", gemm2=ck.GemmTiles(16, 16, 16)),
                 plan("cublas_pro", gemm2=ck.GemmTiles(16, 32, 16, split_k=1))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["gelu", "silu", "relu"])
def test_act_pass_strided_gated_and_bias(dtype, act):
    """One pass over strided inputs (column slices of one buffer), bias and gate included."""
    both = rand(23, 2 * 37, dtype=dtype)
    g, u = both[:, :37], both[:, 37:]
    bias, biasu = rand(37, dtype=dtype), rand(37, dtype=dtype)
    out = ck.act_pass(g, act, bias=bias, u=u, biasu=biasu)
    act_fn = {"gelu": F.gelu, "silu": F.silu, "relu": torch.relu}[act]
    def r(t):  # eager stores each op's result in the dtype
        return t.to(dtype).double()

    ref = r(act_fn(r(g.double() + bias.double()))) * r(u.double() + biasu.double())
    # Triton 3.6's interpreter truncates fp32 -> bf16 casts (the GPU rounds to nearest): with four
    # roundings in a row the bf16 error reaches ~1.1e-2 here, so bf16 gets twice the usual bound.
    tol = 2 * TOL[dtype] if dtype == torch.bfloat16 else TOL[dtype]
    assert out.dtype == dtype and out.is_contiguous()
    assert rel_err(out, ref) < tol
    assert rel_err(ck.act_pass(g, act), act_fn(g.double())) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lib_plan", LIBRARY_PLANS, ids=["epi", "pro16", "pro32"])
def test_library_gemm1_plans_on_matrices(dtype, lib_plan):
    a, b, d = rand(37, 45, dtype=dtype), rand(45, 70, dtype=dtype, scale=45 ** -0.5), rand(70, 19, dtype=dtype,
                                                                                            scale=70 ** -0.5)
    b1 = rand(70, dtype=dtype)
    ops = Operands(a=a, b=b, d=d, bias1=b1, act="gelu")
    ref = F.gelu(a.double() @ b.double() + b1.double()).to(dtype).double() @ d.double()
    assert rel_err(run_plan(lib_plan, ops, exact_fp32=True), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_library_plan_fuses_silu_and_product(dtype):
    a, b, bu = rand(21, 33, dtype=dtype), rand(33, 50, dtype=dtype, scale=0.2), rand(33, 50, dtype=dtype, scale=0.2)
    d, biasu = rand(50, 11, dtype=dtype, scale=0.15), rand(50, dtype=dtype)
    ops = Operands(a=a, b=b, d=d, bu=bu, biasu=biasu, act="silu")
    h = F.silu(a.double() @ b.double()).to(dtype).double() * (a.double() @ bu.double() + biasu.double())
    assert rel_err(run_plan(plan("cublas_epi"), ops), h.to(dtype).double() @ d.double()) < TOL[dtype]
    assert not chain_plans.cublas_pro_plans(ops.shape(), H200)  # the gate has no activation-on-load form


def conv_chain_ref(x, w, b1, d, act):
    h = F.conv2d(x.double(), w.double(), b1.double() if b1 is not None else None, padding=1)
    h = {"gelu": F.gelu, "relu": torch.relu}[act](h).to(x.dtype).double()
    e = F.conv2d(h, d.double().t().reshape(d.shape[1], d.shape[0], 1, 1))
    return e.permute(0, 2, 3, 1).reshape(-1, d.shape[1])  # rows (b, h, w), as our plans return them


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("conv_plan", LIBRARY_PLANS[:2] + [plan("fused", chain=ck.ChainTiles(16, 16, 16, 16)),
                                                           plan("library")], ids=["epi", "pro", "fused", "library"])
def test_conv_chain_plans(dtype, conv_plan):
    """cuDNN's conv (channels-last) or im2col inside the call: both give eager's conv chain."""
    x, w = rand(2, 5, 7, 6, dtype=dtype), rand(9, 5, 3, 3, dtype=dtype, scale=1 / 6)
    d, b1 = rand(9, 4, dtype=dtype, scale=1 / 3), rand(9, dtype=dtype)
    ops = conv_operands(x, w, d, padding=1, act="gelu", bias1=b1)
    assert ops.shape().M == 2 * 7 * 6 and ops.shape().K == 45 and ops.shape().conv_in == x.numel()
    assert rel_err(run_plan(conv_plan, ops, exact_fp32=True), conv_chain_ref(x, w, b1, d, "gelu")) < TOL[dtype]


def test_im2col_matches_unfold_with_reordered_columns():
    x = rand(2, 3, 5, 4, dtype=torch.float32)
    cols = im2col_nhwc(x, 3, 3, 1)                                   # columns (kh, kw, c)
    ref = F.unfold(x, 3, padding=1).transpose(1, 2).reshape(-1, 3, 9)  # columns (c, kh·kw)
    assert torch.equal(cols.reshape(-1, 9, 3).transpose(1, 2), ref)


# ---------------------------------------------------------------- the cost model's pricing

def test_split_reduction_is_a_serial_pass():
    """Round one priced a split-16 GEMM2 (measured 2.2x slower than split 1) as a tie."""
    split1 = ck.GemmTiles(128, 128, 64, 1, 8, 8, 3)
    split16 = ck.GemmTiles(128, 128, 64, 16, 8, 8, 3)
    one = chain_cost.estimate_gemm(2048, 4096, 16384, split1, H200, 2)
    many = chain_cost.estimate_gemm(2048, 4096, 16384, split16, H200, 2)
    partials = 16 * 2048 * 4096 * 4 / H200.hbm_bw
    assert many.seconds > one.seconds + 0.9 * partials
    assert dict(many.times)["reduce"] >= partials


def test_gated_eager_pays_two_elementwise_passes():
    shape = chain_cost.ChainShape(4096, 4096, 14336, 4096, 2, True, "silu")
    eager = chain_cost.estimate_library(shape, H200)
    fused_act = chain_cost.estimate_cublas_epi(shape, H200)
    pass_bytes = 2 * 4096 * 14336 * 2 / H200.hbm_bw  # the pass eager adds: write and re-read of silu(G)
    assert eager.seconds - fused_act.seconds >= 0.9 * pass_bytes


def test_conv_plans_price_the_im2col_copy():
    """With a slow gather the cuDNN plans lead; with a free one the fused im2col plans come back."""
    shape = chain_cost.ChainShape(8 * 56 * 56, 576, 256, 64, 2, False, "gelu", 8 * 64 * 56 * 56)
    assert chain_plans.rank_plans(shape, H200)[0].kind in ("cublas_epi", "cublas_pro")
    fused = next(p for p in chain_plans.rank_plans(shape, H200) if p.kind == "fused")
    assert dict(fused.estimate.times)["im2col"] > shape.M * shape.K * 2 / H200.gather_bw
    fast_gather = chain_cost.profile_for("NVIDIA H200", 4.25e12, 800e12, {"gather_bw": 1e18})
    fused_fast = next(p for p in chain_plans.rank_plans(shape, fast_gather) if p.chain == fused.chain)
    assert fused.estimate.seconds - fused_fast.estimate.seconds > 0.9 * shape.M * shape.K * 2 / H200.gather_bw


def test_probes_enter_the_profile():
    prof = chain_cost.profile_for("NVIDIA H200", 4e12, 7e14, {"triton_mma_eff": 0.5, "unknown": 3.0})
    assert prof.triton_mma_eff == 0.5 and prof.hbm_bw == 4e12 and prof.mma_flops == 7e14
    shape = chain_cost.ChainShape(4096, 4096, 4096, 4096)
    slow = chain_plans.rank_plans(shape, prof, kinds=("two_pass",))[0].estimate.seconds
    fast = chain_plans.rank_plans(shape, chain_cost.profile_for("NVIDIA H200", 4e12, 7e14, {"triton_mma_eff": 1.0}),
                                 kinds=("two_pass",))[0].estimate.seconds
    assert slow > 1.5 * fast


# ---------------------------------------------------------------- the bench's verdicts

def test_bench_acceptance_lines_follow_the_rows():
    from stitchflow.bench.chains import acceptance_lines

    def row(case, eager, compile_s, ours, first, best, floor):
        return {"case": case, "eager_s": eager, "compile_s": compile_s, "ours_s": ours, "model_first_s": first,
                "best_profiled_s": best, "hbm_floor": floor, "flop_floor": floor / 2}

    rows = [row("membound a", 90e-6, 80e-6, 25e-6, 25e-6, 25e-6, 5e-6),
            row("gpt6.7b ffn M=128", 92e-6, 91e-6, 90e-6, 95e-6, 90e-6, 64e-6),
            row("swiglu prefill M=4096", 2100e-6, 1860e-6, 1990e-6, 2500e-6, 1990e-6, 1800e-6)]
    text = "\n".join(acceptance_lines(rows))
    assert "faster than eager and torch.compile: holds (3.20×" in text
    assert "M=128 within 1.25× of its floor and faster than eager: does not hold (1.41×" in text
    assert "5% slower than the best of eager and torch.compile: does not hold (swiglu prefill M=4096 0.93×)" in text
    assert "≥80% of shapes: does not hold over this run's shapes (2/3)" in text


# ---------------------------------------------------------------- cuBLASLt's activation epilogue

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act,bias", [("relu", True), ("gelu_tanh", True), ("relu", False)])
def test_lt_plan_takes_the_activation_in_the_gemm(dtype, act, bias):
    a, b, d = rand(37, 45, dtype=dtype), rand(45, 70, dtype=dtype, scale=45 ** -0.5), rand(70, 19, dtype=dtype,
                                                                                            scale=70 ** -0.5)
    b1 = rand(70, dtype=dtype) if bias else None
    ops = Operands(a=a, b=b, d=d, bias1=b1, act=act)
    fn = {"relu": torch.relu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}[act]
    h = a.double() @ b.double() + (b1.double() if bias else 0)
    ref = fn(h).to(dtype).double() @ d.double()
    assert rel_err(run_plan(plan("cublas_lt"), ops, exact_fp32=True), ref) < TOL[dtype]


def test_lt_plans_only_for_the_epilogue_activations():
    """cuBLASLt has ReLU and tanh-GELU; for those the plan skips the pass over h, so it is priced under cublas_epi."""
    for act in ("relu", "gelu_tanh"):
        shape = chain_cost.ChainShape(8192, 1024, 4096, 1024, 2, False, act)
        ranked = {p.kind: p for p in chain_plans.rank_plans(shape, H200)}
        assert ranked["cublas_lt"].estimate.seconds < ranked["cublas_epi"].estimate.seconds
    for shape, why in ((chain_cost.ChainShape(8192, 1024, 4096, 1024, 2, False, "gelu"), "not gelu"),
                       (chain_cost.ChainShape(8192, 1024, 4096, 1024, 2, True, "relu"), "gated"),
                       (chain_cost.ChainShape(8 * 56 * 56, 576, 256, 64, 2, False, "relu", 8 * 64 * 56 * 56),
                        "convolution")):
        assert all(p.kind != "cublas_lt" for p in chain_plans.rank_plans(shape, H200))
        assert any(f"no cublas_lt plan: " in line and why in line for line in chain_plans.explain_shape(shape, H200))
