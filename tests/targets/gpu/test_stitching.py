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
from stitchflow.targets.gpu.codegen_welford import phased_riding  # noqa: E402
from stitchflow.targets.gpu.grouping import TorchStep  # noqa: E402
from stitchflow.targets.gpu.runtime import cache_dir, load_choice, load_timing, save_choice  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests on CPU tensors: a GPU session (TRITON_INTERPRET=0) "
                                "runs the device tests (test_coop_*, test_chain_hopper, ...) instead")

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
    "prefetch": {"block_l": 16, "prefetch": True},
    "prefetch-split": {"block_l": 16, "split": 3, "prefetch": True},
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
    # a launch per stage only when rows are split, a centred variance riding its mean's (codegen_welford)
    riding = len(phased_riding(kernel.graph, plan, cfg))
    expected = plan.final_stage + 1 - riding if cfg.split > 1 and plan.reductions else 1
    assert LAUNCHES[kernel.title] == expected
    if name == "add_layernorm_gelu" and cfg.split > 1:
        assert riding == 1 and expected == 2  # mean and variance, then the outputs


def test_split_rows_stitch_through_global_memory():
    module = PATTERNS["add_layernorm_gelu"].module()
    args = _inputs("add_layernorm_gelu", (5, 130), torch.float32)
    prog = stitchflow.compile(module, args, target="gpu", fusion="full", options={"block_l": 16, "split": 4})
    LAUNCHES.clear()
    _check(prog, module, args, torch.float32)
    assert sum(LAUNCHES.values()) == 2  # mean with the pieces' centred variances | combine, normalise + gelu


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_norm_is_one_kernel_that_equals_eager(dtype):
    import torch.nn.functional as F

    w, b = torch.randn(12).to(dtype), torch.randn(12).to(dtype)
    x = (torch.randn(3, 12, 5, 7) * 2 + 3).to(dtype)
    fn = lambda x: F.group_norm(x, 4, w, b)  # noqa: E731
    prog = stitchflow.compile(fn, [x], target="gpu", fusion="full")
    assert relative_error(prog(x), fn(x)) <= tolerance(dtype)
    assert len([k for run in prog._compiled for k in run.kernels]) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_norm_and_its_elementwise_consumers_are_one_kernel(dtype):
    """The consumers of group norm's output (x's shape, a reshape of the grouped node) compute in the grouped
    coordinates, so they read it with plain indices: SiLU, a residual of x's shape, a per-channel bias."""
    import torch.nn.functional as F

    r, bias = torch.randn(3, 12, 5, 7).to(dtype), torch.randn(12, 1, 1).to(dtype)
    x = (torch.randn(3, 12, 5, 7) * 2 + 3).to(dtype)
    fn = lambda x: F.silu(F.group_norm(x, 4) + r) * 2 + bias  # noqa: E731
    prog = stitchflow.compile(fn, [x], target="gpu", fusion="full")
    out = prog(x)
    assert out.shape == x.shape and relative_error(out, fn(x)) <= tolerance(dtype)
    assert len([k for run in prog._compiled for k in run.kernels]) == 1


def test_autotuning_choices_keep_their_timings_for_later_processes():
    save_choice("test-key", 1, {"BP1_BL64_S1_W4": 12.5, "BP1_BL128_S1_W4": 10.25})
    assert load_choice("test-key") == 1 and load_timing("test-key", "BP1_BL128_S1_W4") == 10.25
    assert load_timing("test-key", "BP1_BL256_S1_W4") is None and load_timing("no-such-key", "x") is None


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


@pytest.mark.parametrize("fn", [
    lambda x: x.sum(), lambda x: x.abs().sum().sqrt() + 1, lambda x: x - x.mean(), lambda x: torch.std(x),
    lambda x: x.var(0) + x.var(), lambda x: (x - x.mean(0)) / x.std(0), lambda x: x.amin(-1) * x.amin(),
], ids=["sum", "scalar_then_elementwise", "scalar_broadcast", "std_all", "var_rows_and_all", "column_std", "amin"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reductions_to_a_scalar_and_variances(fn, dtype):
    """0-d results: a block stored at a scalar address, and elementwise math after a full
    reduction (once split into a part of its own that re-evaluated the reduction's body)."""
    x = (torch.randn(37, 19, generator=torch.Generator().manual_seed(0)) * 2 + 3).to(dtype)
    prog = stitchflow.compile(fn, (x,), target="gpu", fusion="full")
    out, ref = prog(x), fn(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert relative_error(out, ref) <= tolerance(dtype)
    assert not any(isinstance(s, TorchStep) for c in prog.compiled for s in c.steps)


def test_a_reduction_read_by_another_loop_nest_ends_the_kernel():
    """x[::2, ::2] + x[:, 1::2].sum(): the sum's loop nest shares no axis with the add's, so they
    were two parts of one kernel and the add read a reduction no part of it had computed."""
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    for fn in (lambda x: x[::2, ::2] + x[:, 1::2].sum(),
               lambda x: F.max_pool2d(x[None], 2)[0] + F.avg_pool1d(x[:, None], 4)[:, 0].sum()):
        prog = stitchflow.compile(fn, (x,), target="gpu", fusion="full")
        torch.testing.assert_close(prog(x), fn(x), rtol=1e-5, atol=1e-4)
        assert sum(1 for c in prog.compiled for s in c.steps if not isinstance(s, TorchStep)) >= 2


def test_a_reduction_broadcast_along_another_tensors_axis_is_reduced_once():
    """y * (x * x).sum(-1, keepdim=True): the readers of the row sum walk y's feature axis, which no
    input joins to the sum's own. In one loop nest every program reduced its row again for each of
    y's features (a Llama block's RMS norm backward took 6.6 ms so); the sum now ends the kernel."""
    def fn(x, y):
        return y * (x * x).sum(-1, keepdim=True) + y

    for dtype in (torch.float32, torch.bfloat16):
        x, y = torch.randn(8, 96, dtype=dtype), torch.randn(8, 80, dtype=dtype)
        prog = stitchflow.compile(fn, (x, y), target="gpu", fusion="full")
        LAUNCHES.clear()
        got = prog(x, y)
        assert relative_error(got, fn(x, y)) <= tolerance(dtype)
        parts = [p for k in _kernels(prog) for p in k.plans]
        assert len(parts) == 2 and sum(LAUNCHES.values()) == 2
        summing = next(p for p in parts if any(n.reduce for n in p.nodes))
        assert [summing.extents[c] for c in summing.P if summing.extents[c] > 1] == [8]  # rows only


@pytest.mark.parametrize("fn", [torch.round, torch.floor, torch.ceil, torch.log1p, torch.expm1, torch.sin, torch.cos],
                         ids=lambda f: f.__name__)
def test_rounding_and_small_argument_functions_at_their_edges(fn):
    """Ties to even, whole numbers past 2^23, infinities, NaN, and log1p/expm1 near 0 and far out."""
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, 1e-8, -1e-8, 1e9, float("inf"), -float("inf"), float("nan"),
                       100.0, -100.0, -1.0, 3.7, -2.2]])
    prog = stitchflow.compile(fn, (x,), target="gpu", fusion="full")
    torch.testing.assert_close(prog(x), fn(x), rtol=2e-6, atol=0, equal_nan=True)


def test_atan2_takes_signed_zeros_and_infinities_as_c_does():
    """The generated atan2 (no libdevice here) in every quadrant and at its special points: -0 counts as
    negative, both infinite gives odd multiples of pi/4, NaN stays NaN."""
    special = [0.0, -0.0, 1.0, -1.0, 1e-30, -3.5, float("inf"), -float("inf"), float("nan")]
    y, x = torch.tensor(special).repeat_interleave(len(special)), torch.tensor(special).repeat(len(special))
    y, x = torch.cat([y, torch.randn(200) * 10]), torch.cat([x, torch.randn(200) * 10])
    prog = stitchflow.compile(torch.atan2, (y, x), target="gpu", fusion="full")
    out = prog(y, x)
    torch.testing.assert_close(out, torch.atan2(y, x), rtol=2e-6, atol=0, equal_nan=True)
    numbers = ~out.isnan()
    assert torch.equal(torch.signbit(out[numbers]), torch.signbit(torch.atan2(y, x)[numbers]))
    negated = stitchflow.compile(lambda x: 1.0 / -x, (x,), target="gpu", fusion="full")  # -(0.0) is -0.0
    torch.testing.assert_close(negated(x), 1.0 / -x, equal_nan=True)


@pytest.mark.parametrize("fn", [torch.tan, torch.sinh, torch.cosh, torch.asin, torch.acos, torch.atan, torch.asinh,
                                torch.acosh, torch.atanh], ids=lambda f: f.__name__)
def test_trigonometric_and_hyperbolic_functions_at_their_edges(fn):
    """Near 0 (where sinh, asinh and atanh would cancel without expm1 and log1p), at the ends of the
    inverses' domains and past them (NaN), far out (asinh and acosh past 2^28, where x*x overflows) and at
    infinities. Not 88.7 < |x| < 89.4: there eager's CPU sinh and cosh overflow to inf although the
    answer (which we give) is finite."""
    x = torch.tensor([[0.0, 1e-8, -1e-8, 1e-3, 0.5, -0.5, 0.999999, -0.999999, 1.0, -1.0, 1.0000001, 2.0, -2.0, 8.99,
                       9.01, -20.0, 80.0, 1e9, -1e9, 3e19, -3e19, float("inf"), -float("inf"), float("nan")]])
    prog = stitchflow.compile(fn, (x,), target="gpu", fusion="full")
    torch.testing.assert_close(prog(x), fn(x), rtol=4e-6, atol=1e-7, equal_nan=True)


def test_nan_is_kept_by_maxima_as_in_torch():
    """tl.maximum and tl.max drop a NaN operand; torch's maximum, relu, amax and max(dim) keep it."""
    x = torch.randn(6, 37, generator=torch.Generator().manual_seed(0))
    x[1, 4] = x[3, 30] = float("nan")
    for fn in (lambda x: x.amax(-1), lambda x: x.amax(0), lambda x: torch.maximum(x, x[:, :1]).relu() + torch.minimum(x[:, :1], x),
               lambda x: torch.max(x, -1), lambda x: x.argmax(0)):
        prog = stitchflow.compile(fn, (x,), target="gpu", fusion="full")
        for o, r in zip(as_tuple(prog(x)), as_tuple(fn(x))):
            torch.testing.assert_close(o, r, equal_nan=True)


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
    """Everything between the GEMMs as generated kernels; the GEMMs as chain steps (with their epilogues) or
    through torch. BERT's output projection reads the attention output laid out for it, so no GEMM of that
    block is left to torch."""
    from stitchflow.apps import APPS

    model, inputs = APPS[app].build(size="small")
    prog = stitchflow.compile(model, inputs, target="gpu", fusion="auto")
    with torch.no_grad():
        out, ref = prog(*inputs), model(*inputs)
    out, ref = as_tuple(out)[0], as_tuple(ref)[0]
    assert relative_error(out, ref) <= 1e-5
    chains = [c for run in prog._compiled for c in run.chains]
    assert _kernels(prog) and chains and (_torch_steps(prog) or app == "bert")


@pytest.mark.parametrize("app", ["gcn", "graphsage"])
def test_gnns_equal_eager(app):
    """Sparse products through torch, dense GEMMs as epilogue chains (GraphSAGE's two GEMMs meet in one add: only
    one of them may take it), the rest generated."""
    from stitchflow.apps import APPS

    model, inputs = APPS[app].build(size="small")
    prog = stitchflow.compile(model, inputs, target="gpu", fusion="auto")
    with torch.no_grad():
        assert relative_error(prog(*inputs), model(*inputs)) <= 1e-5
    assert [c for run in prog._compiled for c in run.chains]


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


def test_contiguous_axes_address_as_one_coordinate():
    """Batch norm's statistics run over (N, H, W): H and W, adjacent and laid out contiguously, are
    addressed as one coordinate (l % (H·W)), not one div/mod per axis; N stays on its own."""
    module = PATTERNS["batchnorm_train"].module()
    args = _inputs("batchnorm_train", (3, 5, 7, 9), torch.float32)
    prog = stitchflow.compile(module, args, target="gpu", fusion="full")
    _check(prog, module, args, torch.float32)
    (k,) = _kernels(prog)
    source = next(iter(k._built.values())).spec.source
    assert "% 63)" in source and "// 63)" in source  # H·W = 63: the run's coordinate, and N's
    assert "% 7)" not in source and "% 9)" not in source  # no per-axis index math left


def test_generated_kernels_are_named_after_their_group():
    """Profiles list each generated kernel under its group's name, not all as `kernel`."""
    from stitchflow.targets.gpu.codegen import kernel_name

    module = PATTERNS["bias_gelu"].module()
    args = _inputs("bias_gelu", (7, 33), torch.float32)
    prog = stitchflow.compile(module, args, target="gpu", fusion="full")
    _check(prog, module, args, torch.float32)
    (k,) = _kernels(prog)
    launch = next(iter(k._built.values()))
    assert launch.spec.name == kernel_name(k.title) and launch.spec.name.startswith("sf_")
    assert f"def {launch.spec.name}(" in launch.spec.source and launch.module.kernel is getattr(
        launch.module, launch.spec.name)


class Rotary(nn.Module):
    """q·cos + rotate_half(q)·sin on heads split off a projection (the Llama layout)."""

    def __init__(self, seq=6, heads=3, dim=8):
        super().__init__()
        self.heads, self.dim = heads, dim
        gen = torch.Generator().manual_seed(0)
        self.register_buffer("cos", torch.randn(seq, dim, generator=gen))
        self.register_buffer("sin", torch.randn(seq, dim, generator=gen))

    def forward(self, x):
        q = x.view(1, x.shape[1], self.heads, self.dim).transpose(1, 2)
        half = self.dim // 2
        return q * self.cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * self.sin


def test_rotary_is_one_loop_nest_without_cross_products():
    """Nodes that only share an input's position axis (q·cos and -q[..., half:]) must not share
    a loop nest over the product of their axes (each would be recomputed and stored once per
    point of the other's heads and features); the concatenation reads its half-width producer
    past that producer's extent, so it recomputes it instead: one kernel, one output."""
    x, module = torch.randn(1, 6, 24), Rotary()
    prog = stitchflow.compile(module, (x,), target="gpu", fusion="full")
    _check(prog, module, (x,), torch.float32)
    (k,) = _kernels(prog)
    for plan in k.plans:
        assert plan.P_total * plan.L_total <= 6 * 24
    assert [o for p in k.plans for o in p.outputs] == list(prog.graph.outputs)


def test_unrelated_nodes_reading_one_input_share_a_loop_nest_only_without_cross_products():
    """Maps of one input over the same axes share one loop nest (the input is read once), and
    so does a per-row map; a map over a head-split view (other axis classes) gets its own."""
    from stitchflow.frontend.capture import capture, symbolic_trace
    from stitchflow.targets.gpu.grouping import plan_group

    class M(nn.Module):
        def forward(self, x, w):
            heads = x.view(5, 3, 4).transpose(0, 1) * 3.0
            return x * 2.0, (x + w).exp(), x[:, 0] + 1.0, heads

    x, w = torch.randn(5, 12), torch.randn(12)
    graph = capture(symbolic_trace(M()), (x, w)).graph
    plans = plan_group(graph, list(graph.nodes), set())
    for p in plans:
        for n in p.nodes:  # no node runs over parallel classes it does not index
            own = p.classes_of(n, [v for v, _ in n.dims])
            assert all(c in own or p.extents[c] == 1 for c in p.P), (n.name, p.P)
    by_output = {o: p for p in plans for o in p.outputs}
    mul, exp, row, heads = graph.outputs
    assert by_output[mul] is by_output[exp] is by_output[row]
    assert by_output[heads] is not by_output[mul]


def test_gqa_head_split_and_merge_heads_read_operands_as_views(monkeypatch):
    """GEMM operands read through head splits (128*h + d), grouped-query heads (4*g + h) and
    merge_heads (k // 128 // 4, k // 128 % 4, k % 128) are strided views (the merged K split
    into digits), not index gathers."""
    from stitchflow.apps import APPS
    from stitchflow.ir.index import Div, Mod
    from stitchflow.targets.gpu import contraction

    def no_gather(*args, **kwargs):
        raise AssertionError("operand gathered through index tensors")

    monkeypatch.setattr(contraction, "_gather_index", no_gather)
    model, inputs = APPS["llama"].build(size="small")
    prog = stitchflow.compile(model, inputs, target="gpu", fusion="auto")
    with torch.no_grad():
        out, ref = prog(*inputs), model(*inputs)
    assert relative_error(as_tuple(out)[0], as_tuple(ref)[0]) <= 1e-5
    merged = [s for s in _torch_steps(prog) if any(
        isinstance(i, Div) for a in s.node.accesses for i in a.indices)]
    assert merged
    for s in merged:
        split = contraction._radix_digits(s.node)
        assert split is not s.node and not any(
            isinstance(x, (Div, Mod)) for a in split.accesses for i in a.indices
            for x in contraction._atoms(i))


def test_flattened_batch_rows_of_an_aten_mm_are_views_not_gathers(monkeypatch):
    """ATen's linear is mm over x.view(B * S, D) (AOTAutograd's graphs, stitchflow.compile's export):
    the output row i is read as x[i // S, i % S, k]; i is split into digits that index the output
    in its place, so the operand is a view; the same for the weight gradient's x^T @ dy (k // S)."""
    from stitchflow.targets.gpu import contraction

    monkeypatch.setattr(contraction, "_gather_index", lambda *a, **k: (_ for _ in ()).throw(AssertionError("gathered")))

    def f(x, w, dy):
        flat = (x * 2).view(-1, x.shape[-1])
        return (flat @ w).view(*x.shape[:-1], -1).relu(), flat.t() @ (dy * 3).view(-1, dy.shape[-1])

    x, w, dy = torch.randn(3, 5, 8), torch.randn(8, 6), torch.randn(3, 5, 6)
    prog = stitchflow.compile(f, (x, w, dy), target="gpu", fusion="auto")
    for out, ref in zip(prog(x, w, dy), f(x, w, dy)):
        assert relative_error(out, ref) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_exact_gelu_rounds_like_eager(dtype):
    """bf16/fp16 GELU uses a short erf (|error| <= 1.5e-7) whose error hides below the output's
    rounding; float32 keeps libdevice's erf. Over a dense sweep of inputs, each result is
    within one output ulp plus the erf error carried through 0.5 x (1 + erf) (that only shows
    in the negative tail, where 1 + erf cancels in float32 for eager too), and across the
    bulk of the distribution it equals eager on almost every element."""
    x = torch.linspace(-8, 8, 20011).to(dtype).reshape(1, -1)
    b = torch.zeros(20011, dtype=dtype)
    module = PATTERNS["bias_gelu"].module()
    prog = stitchflow.compile(module, (x, b), target="gpu", fusion="full")
    out, ref = prog(x, b).float(), module(x, b).float()
    if dtype == torch.float32:  # libdevice's erf on the GPU; the interpreter's and torch's CPU erf
        assert relative_error(out, ref) < 1e-6  # differ by float32 rounding, amplified where 1 + erf cancels
        return
    off = (out - ref).abs()
    ulp = torch.finfo(dtype).eps * ref.abs().clamp_min(torch.finfo(dtype).tiny)
    erf_error = 1.5e-7 + 2 * torch.finfo(torch.float32).eps  # formula + float32 rounding near 1
    assert (off <= ulp + 0.5 * x.float().abs() * erf_error).all()
    bulk = x.float().abs() <= 3
    assert (off[bulk] > 0).float().mean() < 0.01


def test_low_precision_erf_is_chosen_by_the_nodes_dtype(monkeypatch):
    import stitchflow.targets.gpu.runtime as runtime

    sources = []
    build = runtime.build_kernel
    monkeypatch.setattr(runtime, "build_kernel", lambda *a, **k: sources.append(build(*a, **k).source) or build(*a, **k))
    module = PATTERNS["bias_gelu"].module()
    for dtype, expect in ((torch.bfloat16, "_erf_lowp(t"), (torch.float32, "tl.erf(")):
        sources.clear()
        x, b = _inputs("bias_gelu", (3, 40), dtype)
        stitchflow.compile(module, (x, b), target="gpu", fusion="full", options={"autotune": False})(x, b)
        assert sources and expect in sources[0].split("def _part0")[1]


def test_a_column_reduction_too_narrow_to_fill_the_gpu_is_not_packed():
    """Batch norm's statistics over channels-last activations beside its running statistics' update: packed, the
    statistics would take one program per 32 channels over every row (ResNet-18's training step: 270-740 µs per
    batch norm on an H100); alone they may split their rows across programs."""
    from stitchflow.targets.gpu import runs_alone

    class M(nn.Module):
        def forward(self, x, running):
            return x - x.mean(0), running * 0.9

    module = M()
    args = (torch.randn(2050, 64), torch.randn(64))
    prog = stitchflow.compile(module, args, target="gpu", fusion="full")
    LAUNCHES.clear()
    _check(prog, module, args, torch.float32)
    kernels = _kernels(prog)
    assert len(kernels) == 2 and not any(k.packed for k in kernels)
    (statistics,) = [k.plans[0] for k in kernels if k.plans[0].reductions]
    assert statistics.p_contiguous and runs_alone(statistics)
