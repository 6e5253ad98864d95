"""The Gluon wgmma chain kernel on a CPU machine: its GELU's accuracy, its compilation for sm_90
(registers, spills, shared memory, through Triton's ptxas), its refusals and its plans. Gluon has
no interpreter; the device checks (bench/chains_checks.py: wgmma_checks) run it against eager."""


import numpy as np
import pytest
import scipy.special
import torch

from stitchflow.targets.gpu import chain_cost, chain_plans
from stitchflow.targets.gpu.chain_wgmma import (PHI16_COEFFICIENTS, PHI_PAIRS_COEFFICIENTS,
                                                SMEM_BYTES, WgmmaTiles, is_resident, shape_refusal, wgmma_refusal)
from stitchflow.targets.gpu.chains import plan_from_json, plan_to_json

H100 = chain_cost.profile_for("NVIDIA H100 80GB HBM3")


def kernel_gelu(x: np.ndarray) -> np.ndarray:
    """_activation's GELU step by step in float32, as the kernel evaluates it."""
    x = x.astype(np.float32)
    c = [np.float32(v) for v in PHI16_COEFFICIENTS]
    u = np.minimum(np.abs(x), np.float32(9))
    p = u * c[0] + c[1]
    for ci in c[2:]:
        p = p * u + ci
    return np.maximum(x, np.float32(0)) - np.abs(x) * np.exp2(p)


def test_gelu_is_exact_to_a_tenth_of_bf16_rounding():
    x = np.linspace(-9, 12, 400001)
    exact = x * scipy.special.ndtr(x)
    rel = np.abs(kernel_gelu(x) - exact) / np.maximum(np.abs(exact), 1e-300)
    assert rel[np.abs(x) > 1e-6].max() < 5e-4  # bf16's rounding step is 3.9e-3
    far = np.linspace(-40, -9, 1001)  # the tail stays tiny and keeps its sign
    assert np.all(kernel_gelu(far) <= 0) and np.all(np.abs(kernel_gelu(far)) < 1e-16)


def to_bf16(v: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.asarray(v, dtype=np.float64)).to(torch.bfloat16).double().numpy()


def pairs_gelu(x: np.ndarray) -> np.ndarray:
    """The chain kernel's packed GELU (wgmma_kernel._gelu_pairs_asm) step by step: every f16x2
    operation rounds to float16, the final product runs in fp32, the result rounds to bf16."""
    def h(v):
        return np.asarray(v, dtype=np.float64).astype(np.float16).astype(np.float64)
    c = [h(v) for v in PHI_PAIRS_COEFFICIENTS]
    u = np.abs(h(x))
    p = h(c[0] * u + c[1])
    for ci in c[2:]:
        p = h(p * u + ci)
    e = h(np.exp2(p))
    return to_bf16(np.maximum(x, 0) - np.abs(x) * e)


def test_packed_gelu_is_as_close_to_exact_as_eager():
    x = np.linspace(-9, 12, 400001)
    exact = x * scipy.special.ndtr(x)
    big = np.abs(exact) > 1e-3
    steps = np.abs(pairs_gelu(x) - exact)[big] / (np.abs(exact[big]) * 2.0 ** -8)  # in bf16 rounding steps
    xb = to_bf16(x)  # eager rounds A·B to bf16, then takes an fp32 GELU
    eager = np.abs(to_bf16(xb * scipy.special.ndtr(xb)) - exact)[big] / (np.abs(exact[big]) * 2.0 ** -8)
    assert steps.mean() < 0.45 and steps.max() < 3.0
    assert steps.mean() < eager.mean() and steps.max() < eager.max()
    with np.errstate(over="ignore", invalid="ignore"):  # f16 overflows to inf on the way, as on the GPU
        tail = pairs_gelu(np.linspace(-1e6, -5.5, 1001))
        huge = pairs_gelu(np.array([7.0, 300.0, 7e4, 1e6]))
    assert np.all(np.abs(tail) < 4e-8 * 1e6) and np.all(tail <= 0)  # past the fit 2^p only falls: no clamp needed
    assert np.array_equal(huge, to_bf16([7.0, 300.0, 7e4, 1e6]))  # and beyond f16's range GELU(x) = x
    # (an infinite x gives NaN, the -|x|·2^p term being inf·0; eager gives NaN for -inf and inf for inf)


COMPILED = [  # (shape, tiles, act, bias, linear): linear = B and D as nn.Linear hands them over (W1.t(), W2.t())
    ((65536, 64, 256, 64), WgmmaTiles(64, 128, 4, 2, 2, 2), "gelu", False, False),
    ((65536, 64, 256, 64), WgmmaTiles(128, 64, 8, 2, 2, 1), "silu", True, True),
    ((16384, 128, 512, 128), WgmmaTiles(64, 64, 4, 2, 2, 2), "gelu", True, False),   # streamed weights
    ((16384, 128, 512, 128), WgmmaTiles(64, 64, 4, 2, 2, 2), "relu", True, True),
    ((1000, 32, 192, 16), WgmmaTiles(64, 64, 4, 3, 2, 2), "gelu_tanh", False, False),
]


@pytest.fixture(scope="module")
def compiled(compile_sm90):
    """compile_for_sm90 of every COMPILED case, in a fresh process (conftest.run_fresh says why)."""
    return compile_sm90("stitchflow.targets.gpu.chain_wgmma", "WgmmaTiles", COMPILED)


@pytest.mark.parametrize("case", range(len(COMPILED)))
def test_kernel_compiles_for_sm90_without_spills(compiled, case):
    (M, K, N, L), tiles, act, _, _ = COMPILED[case]
    assert shape_refusal(K, N, L, tiles, act) is None
    used = compiled[case]
    assert used["spilled"] == 0
    assert used["smem"] * tiles.programs_per_sm <= SMEM_BYTES
    # the cost model's register estimate decides whether programs_per_sm programs fit an SM: it must agree
    resident = is_resident(K, N, L, tiles)
    model = chain_cost.wgmma_registers(chain_cost.ChainShape(M, K, N, L), tiles, resident)
    assert abs(model - used["registers"]) <= 0.2 * used["registers"]
    for per_sm in (1, 2, 3):
        threads = tiles.num_warps * 32 * per_sm
        assert (model * threads <= 65536) == (used["registers"] * threads <= 65536)


@pytest.mark.parametrize("args,reason", [
    ((64, 256, 64, WgmmaTiles(), "gelu", True), "gated"),
    ((64, 256, 64, WgmmaTiles(), "erf", False), "activation 'erf'"),
    ((48, 256, 64, WgmmaTiles(), "gelu", False), "powers of two"),
    ((64, 320, 64, WgmmaTiles(bn=128), "gelu", False), "multiple of the chunk"),
    ((64, 256, 64, WgmmaTiles(bm=128, num_warps=4), "gelu", False), "16 rows per warp"),
    ((256, 512, 256, WgmmaTiles(bm=128, bn=128, num_warps=8, a_stages=3), "gelu", False), "do not fit"),
])
def test_shape_refusals_name_the_problem(args, reason):
    assert reason in shape_refusal(*args)


def test_refuses_cpu_tensors_and_fp32():
    a, b, d = torch.zeros(64, 64, dtype=torch.bfloat16), torch.zeros(64, 128), torch.zeros(128, 64)
    assert "Hopper" in wgmma_refusal(a, b.bfloat16(), d.bfloat16(), WgmmaTiles(), "gelu")


def test_planner_offers_wgmma_on_hopper_only():
    shape = chain_cost.ChainShape(65536, 64, 256, 64)
    ranked = chain_plans.rank_plans(shape, H100)
    assert ranked[0].kind == "wgmma"  # the memory-bound chain: measured 20 µs against 30 for the Triton kernel
    assert "wgmma" in [p.kind for p in chain_plans.shortlist(shape, H100, 8)]
    assert not chain_plans.wgmma_plans(shape, chain_cost.profile_for("NVIDIA A100-SXM4-80GB"))
    gated = chain_cost.ChainShape(65536, 64, 256, 64, gated=True, act="silu")
    assert not chain_plans.wgmma_plans(gated, H100)


def test_wgmma_plan_survives_the_cache_format():
    plan = next(p for p in chain_plans.rank_plans(chain_cost.ChainShape(16384, 128, 512, 128), H100)
                if p.kind == "wgmma")
    again = plan_from_json(plan_to_json(plan))
    assert again.wgmma == plan.wgmma and again.kind == "wgmma"
    assert "wgmma" in str(plan) and "bm" in str(plan)
