"""The Gluon weight-streaming GEMM on a CPU machine: its compilation for sm_90 (registers, spills,
shared memory), its refusals, its plans and their estimates. Gluon has no interpreter; the device
checks (bench/chains_checks.py: stream_checks) run it against float64 torch."""

import dataclasses

import pytest
import torch

from stitchflow.targets.gpu import chain_cost, chain_plans
from stitchflow.targets.gpu.chain_wgmma import SMEM_BYTES
from stitchflow.targets.gpu.chains import plan_from_json, plan_to_json
from stitchflow.targets.gpu.stream_gemm import StreamTiles, shape_refusal, smem_bytes, stream_refusal

H100 = chain_cost.profile_for("NVIDIA H100 80GB HBM3")
GPT_FFN = chain_cost.ChainShape(128, 4096, 16384, 4096)

COMPILED = [  # (M, N, K), tiles, act, bias, linear weight (nn.Linear's W.t())
    ((128, 16384, 4096), StreamTiles(128, 128, 64, 7, 1, 4), "gelu", False, False),
    ((128, 16384, 4096), StreamTiles(128, 128, 128, 3, 1, 4), "gelu", True, True),
    ((128, 4096, 16384), StreamTiles(128, 64, 64, 8, 2, 8), "none", False, True),
    ((128, 4096, 16384), StreamTiles(128, 128, 64, 6, 4, 8), "none", True, False),
    ((16, 14336, 4096), StreamTiles(64, 256, 64, 4, 1, 4), "silu", False, False),
    ((16, 4096, 14336), StreamTiles(64, 128, 64, 8, 2, 4), "relu", True, True),
]


@pytest.fixture(scope="module")
def compiled(compile_sm90):
    return compile_sm90("stitchflow.targets.gpu.stream_gemm", "StreamTiles", COMPILED)


@pytest.mark.parametrize("case", range(len(COMPILED)))
def test_kernel_compiles_for_sm90_without_spills(compiled, case):
    (M, N, K), tiles, act, _, _ = COMPILED[case]
    assert shape_refusal(M, N, K, tiles, act) is None
    used = compiled[case]
    assert used["spilled"] == 0
    assert used["smem"] <= smem_bytes(tiles) <= SMEM_BYTES  # the ring is all the shared memory it takes


@pytest.mark.parametrize("args,reason", [
    ((128, 4096, 4096, StreamTiles(), "erf"), "activation 'erf'"),
    ((128, 4096, 4096, StreamTiles(bn=96), "none"), "powers of two"),
    ((128, 4096, 4096, StreamTiles(bm=64, num_warps=8), "none"), "multiple of 128 rows"),
    ((128, 4096, 4000, StreamTiles(split_k=2, num_warps=8), "none"), "not a multiple of bk*split_k"),
    ((128, 4100, 4096, StreamTiles(), "none"), "multiple of 8"),
    ((128, 4096, 4096, StreamTiles(stages=8), "none"), "do not fit shared memory"),
    ((128, 4096, 4096, StreamTiles(bn=256, split_k=2, num_warps=8), "none"), "do not fit registers"),
])
def test_shape_refusals_name_the_problem(args, reason):
    assert reason in shape_refusal(*args)


def test_refuses_cpu_tensors_and_mixed_dtypes():
    a, b = torch.zeros(128, 512, dtype=torch.bfloat16), torch.zeros(512, 256, dtype=torch.bfloat16)
    assert "Hopper" in stream_refusal(a, b, StreamTiles(), "none")


def test_planner_streams_the_decode_ffn_on_hopper_only():
    ranked = chain_plans.rank_plans(GPT_FFN, H100)
    stream = [p for p in ranked if p.kind == "stream"]
    assert stream and stream[0].streams[1].split_k > 1  # GEMM2's 32 column tiles need split-K to fill 132 SMs
    assert "stream" in [p.kind for p in chain_plans.shortlist(GPT_FFN, H100)]
    # the weights are read once at about the copy rate: the estimate stays near the HBM floor
    floor = GPT_FFN.io_bytes / H100.hbm_bw
    assert floor < stream[0].estimate.seconds < 1.4 * floor
    assert not chain_plans.stream_plans(GPT_FFN, chain_cost.profile_for("NVIDIA A100-SXM4-80GB"))
    for other, why in ((dataclasses.replace(GPT_FFN, M=512), "compute-bound"),
                       (dataclasses.replace(GPT_FFN, gated=True, act="silu"), "gated"),
                       (dataclasses.replace(GPT_FFN, act="sigmoid"), "sigmoid")):
        assert not chain_plans.stream_plans(other, H100)
        assert why in "\n".join(chain_plans.explain_shape(other, H100))


def test_estimate_charges_idle_sms_and_split_k():
    def seconds(M, N, K, t):
        return chain_cost.estimate_stream_gemm(M, N, K, t, H100, 2).seconds
    # 32 column tiles on 132 SMs stream at a quarter of the rate of 128 split-K programs
    assert seconds(128, 4096, 16384, StreamTiles(128, 128, 64, 6, 1, 4)) > \
        2 * seconds(128, 4096, 16384, StreamTiles(128, 128, 64, 6, 4, 8))
    # with the SMs full, splitting further only adds the finish
    assert seconds(128, 16384, 4096, StreamTiles(128, 128, 64, 6, 2, 8)) > \
        seconds(128, 16384, 4096, StreamTiles(128, 128, 64, 6, 1, 4))


def test_stream_plan_survives_the_cache_format():
    plan = next(p for p in chain_plans.rank_plans(GPT_FFN, H100) if p.kind == "stream")
    again = plan_from_json(plan_to_json(plan))
    assert again.streams == plan.streams and again.kind == "stream"
    assert "splitk" in str(plan) and "g2[" in str(plan)
