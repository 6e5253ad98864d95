"""The gpu target under TRITON_INTERPRET=1: every stitching pattern's generated kernel equals
eager at small odd shapes in float32 and bfloat16, each region runs as one generated kernel,
and every mapping (rows in registers, chunk loops, split rows with a global-memory barrier,
packing) gives the same answer."""

import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("STITCHFLOW_CACHE", tempfile.mkdtemp(prefix="stitchflow-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import stitchflow  # noqa: E402
from stitchflow.bench.stitching_patterns import PATTERNS, as_tuple, relative_error, tolerance  # noqa: E402
from stitchflow.targets.gpu import LAUNCHES  # noqa: E402
from stitchflow.targets.gpu.grouping import TorchStep  # noqa: E402
from stitchflow.targets.gpu.runtime import cache_dir  # noqa: E402

CASES = [(name, shape) for name, p in PATTERNS.items() for shape in p.small]


def _inputs(name, shape, dtype, seed=0):
    return PATTERNS[name].make(shape, dtype, "cpu", torch.Generator().manual_seed(seed))


def _check(prog, module, args, dtype):
    out, ref = as_tuple(prog(*args)), as_tuple(module(*args))
    assert len(out) == len(ref)
    for o, r in zip(out, ref):
        assert o.shape == r.shape and o.dtype == r.dtype
        assert not torch.isnan(o).any()
        assert relative_error(o, r) <= tolerance(dtype)


def _kernels(prog):
    return [k for run in prog._compiled for k in run.kernels]


def _torch_steps(prog):
    return [s for run in prog._compiled for s in run.steps if isinstance(s, TorchStep)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,shape", CASES, ids=[f"{n}-{'x'.join(map(str, s))}" for n, s in CASES])
def test_pattern_is_one_kernel_equal_to_eager(name, shape, dtype):
    module = PATTERNS[name].module()
    args = _inputs(name, shape, dtype)
    prog = stitchflow.compile(module, args, target="gpu", fusion="full")
    LAUNCHES.clear()
    _check(prog, module, args, dtype)
    kernels = _kernels(prog)
    assert len(kernels) == 1 and not _torch_steps(prog)
    assert sum(LAUNCHES.values()) == LAUNCHES[kernels[0].title] >= 1
    _check(prog, module, _inputs(name, shape, dtype, seed=1), dtype)  # fresh inputs, same kernel


MAPPINGS = {
    "chunk-loop": {"block_l": 16},
    "split-rows": {"block_l": 16, "split": 3},
    "many-rows": {"block_p": 4, "block_l": 64},
    "one-row": {"block_p": 1},
    "persistent": {"block_l": 16, "persistent": 2},
}


@pytest.mark.parametrize("mapping", sorted(MAPPINGS))
@pytest.mark.parametrize("name,shape", [("add_layernorm_gelu", (5, 130)), ("cross_entropy_like", (5, 130)),
                                        ("column_standardize", (130, 5)), ("softmax_64x30000", (3, 1000)),
                                        ("batchnorm_train", (3, 5, 7, 9)), ("rmsnorm_residual", (7, 33))])
def test_every_mapping_gives_the_same_answer(name, shape, mapping):
    module = PATTERNS[name].module()
    args = _inputs(name, shape, torch.float32)
    prog = stitchflow.compile(module, args, target="gpu", fusion="full", options=MAPPINGS[mapping])
    LAUNCHES.clear()
    _check(prog, module, args, torch.float32)
    (kernel,) = _kernels(prog)
    (plan,) = kernel.plans
    cfg = kernel.chosen[0]
    expected = plan.final_stage + 1 if cfg.split > 1 and plan.reductions else 1
    assert LAUNCHES[kernel.title] == expected  # a phase per stage only when rows are split


def test_split_rows_stitch_through_global_memory():
    module = PATTERNS["add_layernorm_gelu"].module()
    args = _inputs("add_layernorm_gelu", (5, 130), torch.float32)
    prog = stitchflow.compile(module, args, target="gpu", fusion="full", options={"block_l": 16, "split": 4})
    LAUNCHES.clear()
    _check(prog, module, args, torch.float32)
    assert sum(LAUNCHES.values()) == 3  # mean | centred variance | normalise + gelu


def test_index_arithmetic_becomes_addresses():
    x = torch.randn(12, 10)
    y = torch.randn(12, 15)
    idx = torch.tensor([3, 0, 11, 5])

    class M(nn.Module):
        def forward(self, x, y, idx):
            a = x.view(4, 3, 10).permute(1, 0, 2) * 2.0
            b = torch.cat([y[:, 1::3], y[:, 10:]], dim=-1).reshape(3, 4, 10)
            return torch.softmax(a + b, dim=-1), x.index_select(0, idx).t() - 1.0

    module = M()
    prog = stitchflow.compile(module, (x, y, idx), target="gpu", fusion="full")
    LAUNCHES.clear()
    _check(prog, module, (x, y, idx), torch.float32)
    assert len(_kernels(prog)) == 1 and sum(LAUNCHES.values()) == 1  # packed: two parts, one launch


def test_gemm_runs_through_torch_and_its_epilogue_is_generated():
    module = nn.Sequential(nn.Linear(33, 20), nn.GELU(), nn.LayerNorm(20)).eval()
    x = torch.randn(7, 33)
    prog = stitchflow.compile(module, (x,), target="gpu", fusion="full", options={"chains": False})
    with torch.no_grad():
        _check(prog, module, (x,), torch.float32)
    assert len(_torch_steps(prog)) == 1 and len(_kernels(prog)) >= 1


def test_gemm_epilogues_in_a_region_become_chain_kernels():
    module = nn.Sequential(nn.Linear(33, 20), nn.GELU(), nn.LayerNorm(20)).eval()
    x = torch.randn(7, 33)
    prog = stitchflow.compile(module, (x,), target="gpu", fusion="full")
    with torch.no_grad():
        _check(prog, module, (x,), torch.float32)
    (run,) = prog._compiled
    assert run.chains and not _torch_steps(prog)  # linear + bias + gelu fused, layernorm stitched


@pytest.mark.parametrize("fusion", ["auto", "unfused"])
def test_other_fusion_configs(fusion):
    module = PATTERNS["add_layernorm_gelu"].module()
    args = _inputs("add_layernorm_gelu", (7, 33), torch.bfloat16)
    prog = stitchflow.compile(module, args, target="gpu", fusion=fusion)
    _check(prog, module, args, torch.bfloat16)


def test_generated_source_is_cached_on_disk():
    module = PATTERNS["bias_gelu"].module()
    args = _inputs("bias_gelu", (7, 33), torch.float32)
    stitchflow.compile(module, args, target="gpu", fusion="full")(*args)
    sources = list((cache_dir() / "kernels").glob("k_*.py"))
    assert sources and any("@triton.jit" in p.read_text() for p in sources)


def test_cpu_without_interpreter_falls_back_to_torch(monkeypatch):
    module = PATTERNS["scale_mask_softmax"].module()
    args = _inputs("scale_mask_softmax", (3, 5, 33), torch.float32)
    prog = stitchflow.compile(module, args, target="gpu", fusion="full")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    LAUNCHES.clear()
    _check(prog, module, args, torch.float32)
    assert sum(LAUNCHES.values()) == 0


def test_int_and_bool_values():
    class M(nn.Module):
        def forward(self, x, k):
            keep = (k > 2) & (x > 0)
            return torch.where(keep, x * k, -x).sum(-1), (k * 3 + 1)

    x, k = torch.randn(5, 9), torch.randint(0, 5, (5, 9))
    module = M()
    prog = stitchflow.compile(module, (x, k), target="gpu", fusion="full")
    out, ref = prog(x, k), module(x, k)
    torch.testing.assert_close(out[0], ref[0])
    assert torch.equal(out[1], ref[1])


def test_gelu_tanh_and_powers_match():
    class M(nn.Module):
        def forward(self, x):
            return F.gelu(x, approximate="tanh") + x.pow(3) - torch.tanh(x) * x.abs().pow(0.5)

    x = torch.randn(5, 130)
    module = M()
    prog = stitchflow.compile(module, (x,), target="gpu", fusion="full")
    _check(prog, module, (x,), torch.float32)


@pytest.mark.parametrize("app", ["bert", "llama"])
def test_transformer_blocks_equal_eager(app):
    """GEMMs run through torch, everything between them as generated kernels."""
    from stitchflow.apps import APPS

    model, inputs = APPS[app].build(size="small")
    prog = stitchflow.compile(model, inputs, target="gpu", fusion="auto")
    with torch.no_grad():
        out, ref = prog(*inputs), model(*inputs)
    out, ref = as_tuple(out)[0], as_tuple(ref)[0]
    assert relative_error(out, ref) <= 1e-5
    assert _kernels(prog) and _torch_steps(prog)


def test_head_split_attention_scores_run_as_one_einsum():
    """Q·Kᵀ read through head-split reshapes, with a batch of one (a broadcast output dim)."""

    class M(nn.Module):
        def forward(self, x):
            q = x.view(1, 9, 3, 4).transpose(1, 2)
            return torch.softmax(q @ q.transpose(-1, -2) * 0.5, dim=-1)

    x = torch.randn(1, 9, 12)
    prog = stitchflow.compile(M(), (x,), target="gpu", fusion="full")
    _check(prog, M(), (x,), torch.float32)
    (gemm,) = _torch_steps(prog)
    assert gemm.dense_gemm
