"""Compute chains on the CPU under the Triton interpreter: kernels, matcher, compile_chain, cost model."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest
import torch
import torch.nn.functional as F

import stitchflow
from stitchflow.targets.gpu import chain_cost, chain_plans, chain_kernels as ck
from stitchflow.targets.gpu.chain_match import match_chains, match_gemm_epilogues
from stitchflow.targets.gpu.chains import Operands, compile_chain, default_plan, plan_from_json, plan_to_json, run_plan

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests on CPU tensors (forcing the interpreter here would switch "
                                "a GPU session's other tests to it too)")

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
DTYPES = (torch.float32, torch.bfloat16)
M, K, N, L = 37, 45, 70, 19  # odd everywhere: every load and store is masked


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def rand(*shape, dtype, scale=1.0, seed=[0]):
    seed[0] += 1
    g = torch.Generator().manual_seed(seed[0])
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def act_ref(x, act):
    return {"relu": torch.relu, "gelu": F.gelu, "silu": F.silu, "sigmoid": torch.sigmoid,
            "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"), "none": lambda v: v}[act](x)


def operands(dtype, gated=False):
    a = rand(M, K, dtype=dtype)
    b, bu = rand(K, N, dtype=dtype, scale=K ** -0.5), rand(K, N, dtype=dtype, scale=K ** -0.5)
    d = rand(N, L, dtype=dtype, scale=N ** -0.5)
    return a, b, (bu if gated else None), d


def chain_ref(a, b, d, act, dtype, bias1=None, bu=None):
    """Eager semantics: the intermediate is stored (rounded) in the weights' dtype."""
    h = a.double() @ b.double()
    h = act_ref(h + bias1.double() if bias1 is not None else h, act).to(dtype).double()
    if bu is not None:
        h = (h * (a.double() @ bu.double()).to(dtype).double()).to(dtype).double()
    return h @ d.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act,split", [("gelu", 1), ("relu", 3), ("silu", 1), ("gelu_tanh", 2)])
def test_fused_chain(dtype, act, split):
    a, b, _, d = operands(dtype)
    b1 = rand(N, dtype=dtype)
    tiles = ck.ChainTiles(bm=16, bn=32, bk=16, bl=16, split_n=split)
    out, _ = ck.chain(a, b, d, act=act, bias1=b1, tiles=tiles, exact_fp32=True)
    assert rel_err(out, chain_ref(a, b, d, act, dtype, b1)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_chain_with_resident_a_and_epilogue(dtype):
    a, b, bu, d = operands(dtype, gated=True)
    b2, res = rand(L, dtype=dtype), rand(M, L, dtype=dtype)
    tiles = ck.ChainTiles(bm=16, bn=32, bk=64, bl=32)  # K=45 fits one k tile: A stays in registers
    out, stat = ck.chain(a, b, d, act="silu", bu=bu, bias2=b2, residual=res, tiles=tiles, exact_fp32=True,
                         epi2=ck.Epilogue(bias=True, residual=True, rowstat="sum"))
    ref = chain_ref(a, b, d, "silu", dtype, bu=bu) + b2.double() + res.double()
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(stat, out.double().sum(1)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 3])
def test_gemm_epilogue(dtype, split_k):
    a, b, _, _ = operands(dtype)
    bias, res, scale = rand(N, dtype=dtype), rand(M, N, dtype=dtype), rand(M, dtype=torch.float32).abs()
    epi = ck.Epilogue(alpha=0.5, bias=True, act="gelu", residual=True, rowstat="max", row_scale=True, pro_act="relu")
    tiles = ck.GemmTiles(bm=16, bn=32, bk=16, split_k=split_k)
    if split_k > 1:  # a prologue applies per k tile, so it is legal with split-K too
        epi = ck.Epilogue(alpha=0.5, bias=True, act="gelu", residual=True, rowstat="max")
        scale = None
    out, stat = ck.gemm(a, b, epi=epi, bias=bias, residual=res, row_scale=scale, tiles=tiles, exact_fp32=True)
    a_in = a.double() if scale is None else torch.relu(a.double() * scale.double()[:, None]).to(dtype).double()
    ref = F.gelu(0.5 * (a_in @ b.double()) + bias.double()) + res.double()
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(stat, out.double().amax(1)) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_gemm_and_cast(dtype):
    a, b, bu, _ = operands(dtype, gated=True)
    out, _ = ck.gemm(a, b, bu=bu, epi=ck.Epilogue(act="silu"), out_dtype=torch.float32,
                     tiles=ck.GemmTiles(bm=16, bn=32, bk=32), exact_fp32=True)
    assert out.dtype == torch.float32
    ref = F.silu(a.double() @ b.double()) * (a.double() @ bu.double())
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_pass_plan_matches_fused(dtype):
    a, b, bu, d = operands(dtype, gated=True)
    ops = Operands(a=a, b=b, d=d, bu=bu, act="silu")
    two = chain_cost.Plan("two_pass", "", (), gemm1=ck.GemmTiles(16, 32, 16), gemm2=ck.GemmTiles(16, 16, 16, split_k=2))
    fused = chain_cost.Plan("fused", "", (), chain=ck.ChainTiles(16, 32, 16, 16))
    ref = chain_ref(a, b, d, "silu", dtype, bu=bu)
    assert rel_err(run_plan(two, ops, exact_fp32=True), ref) < TOL[dtype]
    assert rel_err(run_plan(fused, ops, exact_fp32=True), ref) < TOL[dtype]


# ---------------------------------------------------------------- matching IR captured from torch

def ffn(x, w1, b1, w2):
    return F.gelu(x @ w1 + b1) @ w2


def swiglu(x, wg, wu, wd):
    return (F.silu(x @ wg) * (x @ wu)) @ wd


def linear_relu(x, w1, b1, w2):
    return torch.relu(F.linear(x, w1, b1)) @ w2.t()


def gemm_bias_gelu_residual(x, w, b, r):
    return F.gelu(F.linear(x, w, b)) + r


def not_a_chain(x, w1, w2):
    h = x @ w1
    return (h @ w2) + h.sum()  # the intermediate has a second consumer: must stay unfused


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn,shapes,expected", [
    (ffn, [(2, 5, 7), (7, 9), (9,), (9, 3)], ("matmul", "add", "gelu", "matmul_1")),
    (swiglu, [(10, 7), (7, 9), (7, 9), (9, 3)], ("matmul", "silu", "matmul_1", "mul", "matmul_2")),
    (linear_relu, [(10, 7), (9, 7), (9,), (3, 9)], ("linear", "linear_bias", "relu", "matmul")),
])
def test_match_and_compile_chain(fn, shapes, expected, dtype):
    args = [rand(*s, dtype=dtype, scale=0.5) for s in shapes]
    graph = stitchflow.compile(fn, args).graph
    chains = match_chains(graph)
    assert chains == [expected]
    env = dict(zip(graph.inputs, args))
    run = compile_chain(graph, chains[0], {})
    run(env)
    out = env[chains[0][-1]]
    assert out.shape == fn(*args).shape and out.dtype == dtype
    assert rel_err(out, fn(*[x.double() for x in args])) < TOL[dtype] * 2


def test_gemm_epilogue_match_and_no_false_chain():
    args = [rand(4, 6, dtype=torch.float32), rand(5, 6, dtype=torch.float32), rand(5, dtype=torch.float32),
            rand(4, 5, dtype=torch.float32)]
    graph = stitchflow.compile(gemm_bias_gelu_residual, args).graph
    assert match_chains(graph) == []
    (names,) = match_gemm_epilogues(graph)
    assert names == ("linear", "linear_bias", "gelu", "add")
    env = dict(zip(graph.inputs, args))
    compile_chain(graph, names)(env)
    assert rel_err(env["add"], gemm_bias_gelu_residual(*args)) < 1e-4
    args2 = [rand(4, 6, dtype=torch.float32), rand(6, 5, dtype=torch.float32), rand(5, 3, dtype=torch.float32)]
    assert match_chains(stitchflow.compile(not_a_chain, args2).graph) == []


def two_gemms_summed(x, ws, y, wn, b):
    return torch.relu(x @ ws + y @ wn + b)  # GraphSAGE's layer: either GEMM could take the add as its epilogue


def residual_inside_a_chain(x, w1, b, w2):
    h = x @ w1 + b                            # a GEMM + bias chain's inner node...
    return torch.relu(h) + x @ w2             # ...read by the other GEMM's add only after the relu


@pytest.mark.parametrize("fn, shapes", [
    (two_gemms_summed, [(M, K), (K, N), (M, L), (L, N), (N,)]),
    (residual_inside_a_chain, [(M, K), (K, N), (N,), (K, N)]),
])
def test_epilogue_chains_never_share_a_node_nor_read_an_unstored_one(fn, shapes):
    args = [rand(*s, dtype=torch.float32) for s in shapes]
    graph = stitchflow.compile(fn, args).graph
    chains = match_gemm_epilogues(graph)
    names = [n for c in chains for n in c]
    assert chains and len(names) == len(set(names))                  # no node in two chains
    inner = {n for c in chains for n in c[:-1]}
    for c in chains:                                                 # every input a chain reads is stored
        assert not (set(graph.node_of[c[-1]].inputs) & inner - set(c))
    prog = stitchflow.compile(fn, args, target="gpu", fusion="full")
    assert rel_err(prog(*args), fn(*[a.double() for a in args])) < TOL[torch.float32]


def gemm_residual(x, w, r):
    return F.linear(x, w) + r


def gemm_bias_relu(x, w, b):
    return torch.relu(F.linear(x, w, b))


def gemm_tanh_gelu(x, w):
    return F.gelu(F.linear(x, w), approximate="tanh")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", [gemm_bias_gelu_residual, gemm_residual, gemm_bias_relu, gemm_tanh_gelu])
def test_gemm_epilogue_runs_fused_or_through_the_library_alike(dtype, fn):
    """The ways a GEMM + epilogue can run (the GPU autotuner keeps the fastest): all equal eager; a residual
    alone, or a ReLU or tanh-GELU, may also ride in the library GEMM's own epilogue."""
    from stitchflow.targets.gpu.chain_match import spec_for
    from stitchflow.targets.gpu.chains import _epilogue_runners, operands_for

    args = [rand(M, K, dtype=dtype), rand(N, K, dtype=dtype)]
    args += {gemm_bias_gelu_residual: [rand(N, dtype=dtype), rand(M, N, dtype=dtype)],
             gemm_residual: [rand(M, N, dtype=dtype)], gemm_bias_relu: [rand(N, dtype=dtype)], gemm_tanh_gelu: []}[fn]
    graph = stitchflow.compile(fn, args).graph
    (names,) = match_gemm_epilogues(graph)
    ops = operands_for(spec_for(graph, names), dict(zip(graph.inputs, args)))
    ref = fn(*[a.double() for a in args])
    runners = _epilogue_runners(ops, dtype, exact=True)
    assert ("library_accumulate" in runners) == (fn is gemm_residual)
    assert ("library_act" in runners) == (fn in (gemm_bias_relu, gemm_tanh_gelu))  # cuBLASLt's epilogue
    for name, run in runners.items():
        out = run()
        assert out.shape == ref.shape, name
        assert rel_err(out, ref) < TOL[dtype], name


# ---------------------------------------------------------------- cost model

H100 = chain_cost.profile_for("NVIDIA H100 80GB HBM3")


def test_cost_model_prefers_fusion_when_memory_bound():
    shape = chain_cost.ChainShape(65536, 64, 256, 64)
    ranked = chain_plans.rank_plans(shape, H100)
    assert ranked[0].kind in ("fused", "resident", "wgmma")
    library = next(p for p in ranked if p.kind == "library")
    assert library.estimate.seconds > 1.5 * ranked[0].estimate.seconds
    assert dict(ranked[0].levels)["h"] == "registers"


def test_cost_model_decode_ffn_uses_global_intermediate_and_split():
    shape = chain_cost.ChainShape(128, 4096, 16384, 4096)
    best = chain_plans.rank_plans(shape, H100, kinds=("fused", "resident", "two_pass"))[0]
    assert best.kind == "two_pass"  # L=4096 cannot be one tile: fusing would recompute GEMM1 per l tile
    assert dict(best.levels)["h"] == "hbm"
    floor = shape.io_bytes / H100.hbm_bw
    assert floor <= best.estimate.seconds < 2.5 * floor
    # cuBLAS streams the weights faster than our Triton GEMMs (profile: library_stream_eff >
    # triton_stream_eff), so a library GEMM1 plan leads once those kinds are allowed; on Hopper
    # the Gluon stream GEMMs lead them (H100: 107.6 µs against cuBLAS's 113.6)
    no_gluon = tuple(k for k in chain_plans.ALL_KINDS if k != "stream")
    assert chain_plans.rank_plans(shape, H100, no_gluon)[0].kind in ("library", "cublas_epi")
    assert chain_plans.rank_plans(shape, H100)[0].kind == "stream"


def test_cost_model_respects_capacity():
    shape = chain_cost.ChainShape(4096, 256, 4096, 256)
    for plan in chain_plans.fused_plans(shape, H100):
        t = plan.chain
        smem = t.num_stages * (t.bm * t.bk + t.bk * t.bn) * 2 + 2 * t.bn * t.bl * 2 + t.bm * t.bn * 2
        assert smem <= H100.smem_per_block
        assert (t.bm * t.bn + t.bm * t.bl) // (t.num_warps * 32) <= 255
    huge = ck.ChainTiles(bm=128, bn=128, bk=128, bl=256, num_warps=4, num_stages=3)
    assert chain_cost.estimate_fused(shape, huge, H100) is None


def test_cluster_plans_follow_the_hardware():
    shape = chain_cost.ChainShape(16384, 128, 2048, 128)
    sizes = {p.cluster for p in chain_plans.cluster_plans(shape, H100)}
    assert sizes == {2, 4, 8, 16}
    assert chain_cost.cluster_usable_sms(H100, 16) == 112
    assert not chain_plans.cluster_plans(chain_cost.ChainShape(128, 4096, 16384, 4096), H100)  # L too large


def test_shortlist_is_diverse_and_plans_round_trip():
    shape = chain_cost.ChainShape(16384, 128, 512, 128)
    short = chain_plans.shortlist(shape, H100, k=6)
    kinds = {p.kind for p in chain_plans.rank_plans(shape, H100)} - {"cluster"}  # the cluster kernel is timed apart
    assert len(short) == max(6, len(kinds)) and {"fused", "library", "wgmma"} <= {p.kind for p in short}
    for plan in short:
        back = plan_from_json(plan_to_json(plan))
        assert (back.kind, back.chain, back.gemm1, back.gemm2) == (plan.kind, plan.chain, plan.gemm1, plan.gemm2)
    assert default_plan(shape, H100).kind == "fused"


@pytest.mark.parametrize("dtype", DTYPES)
def test_even_shapes_take_the_unmasked_paths(dtype):
    """Shapes that are multiples of the tiles skip the K and N masks (vectorized loads)."""
    a, b, bu, d = (rand(24, 64, dtype=dtype), rand(64, 128, dtype=dtype, scale=0.125),
                   rand(64, 128, dtype=dtype, scale=0.125), rand(128, 32, dtype=dtype, scale=0.1))
    for gated, split in ((False, 2), (True, 1)):
        out, _ = ck.chain(a, b, d, act="silu", bu=bu if gated else None, exact_fp32=True,
                          tiles=ck.ChainTiles(bm=16, bn=32, bk=32, bl=32, split_n=split))
        ref = chain_ref(a, b, d, "silu", dtype, bu=bu if gated else None)
        assert rel_err(out, ref) < TOL[dtype]
    out, _ = ck.gemm(a, b, epi=ck.Epilogue(act="relu"), tiles=ck.GemmTiles(16, 32, 16, split_k=2), exact_fp32=True)
    assert rel_err(out, torch.relu(a.double() @ b.double())) < TOL[dtype]


def test_explain_ranks_the_chain_plans_and_says_why_a_kind_is_missing():
    from torch import nn

    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    prog = stitchflow.compile(model, [torch.randn(2, 20, 32)], target="gpu", fusion="auto")  # M = 2·20 rows
    prog.options["gpu_profile"] = "H100"
    text = prog.explain()
    assert "chain plans on H100" in text and "M=40 K=32 N=64 L=16 gelu, 32-bit" in text
    assert "1. " in text and "no wgmma plan: 16-bit operands only" in text
    prog.options["gpu_profile"] = "NVIDIA A100-SXM4-80GB"
    assert "no wgmma plan: needs a Hopper GPU" in prog.explain()


def test_float64_chains_and_siblings_stay_with_torchs_gemms():
    """The Triton GEMMs multiply in float32 at most: a float64 GEMM with an epilogue, and GEMMs of one input, run
    as torch's (exact) instead of as a chain or a grouped launch."""
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(36, 16, generator=g, dtype=torch.float64) for _ in range(3))
    w1, w2 = w1[:16], w2[:16]

    def f(x, w1, w2):
        return (x @ w1).relu() + x @ w2

    prog = stitchflow.compile(f, (x, w1, w2), target="gpu", fusion="auto")
    out = prog(x, w1, w2)
    assert (out - f(x, w1, w2)).abs().max().item() < 1e-12
    assert not any(run.chains or run.siblings for run in prog._compiled)
