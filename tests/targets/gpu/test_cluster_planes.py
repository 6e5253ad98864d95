"""Plane and row statistics on thread-block clusters (cluster_planes): a CUDA C++ kernel whose CTAs exchange batch
norm's and group norm's statistics, or a long row's maximum and sum of exponentials, through distributed shared
memory, with the epilogue printed from the IR. On CPU: what it takes and refuses, the emitted source, and an nvcc
compile for sm_90a (registers, no spills) where nvcc exists; on a Hopper GPU: equality with eager for every cluster
size, through the autotuned path too."""

import os
import shutil
import subprocess
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("STITCHFLOW_CACHE", tempfile.mkdtemp(prefix="stitchflow-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import stitchflow  # noqa: E402
from stitchflow.bench.stitching_patterns import PATTERNS, as_tuple, relative_error, tolerance  # noqa: E402
from stitchflow.targets.gpu import cluster_planes  # noqa: E402
from stitchflow.targets.gpu.cluster_planes import ClusterRefusal, analyze, cluster_plans, emit_module  # noqa: E402
from stitchflow.targets.gpu.emit import contiguous_strides  # noqa: E402


class AffineFree(nn.Module):
    def forward(self, x):
        mean = x.mean((0, 2, 3), keepdim=True)
        xc = x - mean
        return xc * torch.rsqrt((xc * xc).mean((0, 2, 3), keepdim=True) + 1e-5)


class ResidualRelu(nn.Module):
    """Batch norm, then a residual read at x's coordinates (streamed in the epilogue), then relu; two outputs."""

    def forward(self, x, w, b, r):
        mean = x.mean((0, 2, 3), keepdim=True)
        xc = x - mean
        y = xc * torch.rsqrt((xc * xc).mean((0, 2, 3), keepdim=True) + 1e-5) * w[:, None, None] + b[:, None, None]
        return torch.relu(y + r), y


class Center(nn.Module):
    def forward(self, x):
        return x - x.mean((0, 2, 3), keepdim=True)


class ScaledSoftmax(nn.Module):
    """A softmax whose maximum and terms read an elementwise node of x (the scaled scores), not x itself."""

    def forward(self, x):
        return torch.softmax(x * 0.125, dim=-1)


class LogSoftmax(nn.Module):
    def forward(self, x):
        return torch.log_softmax(x, dim=-1)


class LongLayerNorm(nn.Module):
    """A mean and centred variance over one long row: the moments on a row cut into pieces."""

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],))


class _Functional(nn.Module):
    def forward(self, x, w, b):
        return F.batch_norm(x, None, None, w, b, training=True)


def _args(module, shape, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype).to(device)
    if isinstance(module, ResidualRelu):
        w, b = (torch.randn(shape[1], generator=gen).to(dtype).to(device) for _ in range(2))
        return [x, w, b, torch.randn(shape, generator=gen).to(dtype).to(device)]
    if isinstance(module, (AffineFree, Center, TransposedResidual, Softmax, ScaledSoftmax, LongLayerNorm, LogSoftmax)):
        return [x]
    return list(PATTERNS["batchnorm_train"].make(shape, dtype, device, gen))


def _kernel(module, shape, dtype=torch.float32):
    prog = stitchflow.compile(module, _args(module, shape, dtype), target="gpu", fusion="full")
    (k,) = [k for run in prog._compiled for k in run.kernels]
    return k, {t: contiguous_strides(k.graph.type_of[t].shape) for t in k.inputs}


BN = PATTERNS["batchnorm_train"].module
GN = PATTERNS["groupnorm_silu"].module  # F.group_norm (32 groups) then SiLU
Softmax = PATTERNS["softmax_long_rows"].module  # torch.softmax over the last axis
MODULES = [(BN, (64, 256, 56, 56), torch.float32), (BN, (6, 10, 4, 6), torch.bfloat16),
           (AffineFree, (16, 40, 28, 28), torch.float32), (ResidualRelu, (6, 10, 4, 6), torch.float32),
           (ResidualRelu, (16, 40, 28, 28), torch.bfloat16), (Center, (8, 24, 7, 16), torch.float16),
           (GN, (16, 512, 64, 64), torch.bfloat16), (GN, (3, 128, 6, 10), torch.float32),
           (GN, (2, 64, 16, 8), torch.float16), (Softmax, (6, 65536), torch.float32),
           (ScaledSoftmax, (3, 5, 40000), torch.bfloat16), (LongLayerNorm, (5, 40960), torch.float32),
           (LogSoftmax, (1, 3, 40960), torch.float16)]


def test_batch_norm_exchanges_through_peers_and_prints_its_epilogue_from_the_ir():
    k, strides = _kernel(BN(), (64, 256, 56, 56))
    cp = analyze(k.graph, k.plans[0], strides, 8)
    assert (cp.x, cp.planes, cp.plane, cp.channels, cp.stats.var) == ("x", 8, 3136, 256, "mean_1")
    assert [t for t, _ in cp.params] == ["w", "b"] and cp.streamed == () and cp.outputs == ("add_1",)
    assert str(cp).startswith("cluster of 8 x 8 planes of 3136 over 256 channels")
    cuda, glue = emit_module(k.graph, k.plans[0], [cp])
    assert "st.async.shared::cluster.mbarrier::complete_tx::bytes" in cuda and "mapa.shared::cluster" in cuda
    assert "const float s_mean_1 = (m2 * 4.982461734693877e-06f);" in cuda
    assert "const float s_rsqrt = rsqrtf(s_add);" in cuda and "const float p_w = to_f(in_w[c * 1]);" in cuda
    assert "const float v_add_1 = (v_mul_2 + p_b);" in cuda and "o_add_1.a[e] = from_f<float>(v_add_1);" in cuda
    assert "case 0: err = planes_0_launch(" in glue
    # the parameters are read before the exchange, the epilogue after it
    assert cuda.index("in_w[c * 1]") < cuda.index("mbar_wait(&bars[1 + slot]") < cuda.index("v_sub")


def test_group_norm_runs_its_groups_channel_major_with_parameters_per_plane():
    """Group norm's statistics run over (channel in group, H, W) of each (image, group): the channel is the two
    parallel axes flattened, its planes lie together, and the weight and bias vary from plane to plane."""
    k, strides = _kernel(GN(), (16, 512, 64, 64), torch.bfloat16)
    plans, _ = cluster_plans(k.graph, k.plans[0], strides)
    cp = plans[0]
    assert (cp.x, cp.view, cp.channel_major, cp.channels, cp.n, cp.plane) == ("x", "group_norm_grouped", True,
                                                                              512, 16, 4096)
    assert (cp.cluster, cp.planes) == (4, 4) and [p.cluster for p in plans[:2]] == [4, 8]  # 16384, 8192 elements
    assert cp.params == () and dict(cp.plane_params) == {"w": "(c % 32) * 16 + n * 1", "b": "(c % 32) * 16 + n * 1"}
    cuda, _ = emit_module(k.graph, k.plans[0], [cp])
    assert "return (size_t)c * NPL + n;" in cuda and "const float p_w = to_f(in_w[(c % 32) * 16 + n * 1]);" in cuda
    assert "v_group_norm_grouped" not in cuda  # the view is x itself
    # the bf16 SiLU on the special-function unit; float32 nodes (group_norm_centered) stay exact
    assert "__fdividef(1.0f, 1.0f + __expf(" in cuda and "__expf" not in cuda.split("v_group_norm_centered")[1][:80]
    bn, strides = _kernel(BN(), (64, 256, 56, 56))
    assert "return (size_t)n * C + c;" in emit_module(bn.graph, bn.plans[0], cluster_plans(bn.graph, bn.plans[0],
                                                                                           strides)[0])[0]


def test_a_long_softmax_row_is_cut_into_pieces_that_exchange_their_maximum_and_sum_of_exponentials():
    k, strides = _kernel(Softmax(), (8, 65536))
    plans, _ = cluster_plans(k.graph, k.plans[0], strides)
    assert [(p.cluster, p.plane, p.n, p.planes, p.rows, p.channel_major) for p in plans[:2]] == \
        [(4, 16384, 4, 1, True, True), (8, 8192, 8, 1, True, True)]  # pieces nearest 16K elements first
    cp = plans[0]
    assert (cp.stats.kind, cp.stats.max, cp.stats.sum, cp.channels) == ("softmax", "softmax_max", "softmax_sum", 8)
    assert str(cp).startswith("cluster of 4 pieces of 16384 per row of 65536, 8 rows (x: max softmax_max")
    cuda, _ = emit_module(k.graph, k.plans[0], [cp])
    # the piece's own maximum, its terms against it (0 while it is -inf), then the row's from every CTA's pair
    assert "block_max<THREADS>(mx, red[0])" in cuda and "const float t_softmax_exp = __expf((xv - mref));" in cuda
    assert "bs_[r] * __expf(as_[r] - mmax)" in cuda and "const float s_softmax_sum = ssum;" in cuda
    assert "const float v_softmax = (v_softmax_exp / s_softmax_sum);" in cuda
    assert cuda.index("mref") < cuda.index("push(mapa(laddr, r), sa, sb") < cuda.index("v_softmax_exp")
    # the scaled scores: the node both statistics read is defined in each pass
    k, strides = _kernel(ScaledSoftmax(), (3, 5, 40000), torch.bfloat16)
    plans, why = cluster_plans(k.graph, k.plans[0], strides)
    assert [p.cluster for p in plans] == [2, 4, 8] and "16-byte vectors" in why[0]  # 2500 bf16 a piece
    cuda, _ = emit_module(k.graph, k.plans[0], plans[:1])
    stats = cuda[cuda.index("float mx = -INFINITY;"):cuda.index("block_sum<THREADS>(s, red[1])")]
    assert stats.count("const float t_mul") == 2 and "mx = nanmax(mx, ((float)t_mul));" in stats
    assert "const float t_mul = rnd_bf16((xv * 0.125f));" in stats  # rounded as eager rounds the bf16 node


def test_a_long_row_of_a_tensor_with_axes_of_one_and_a_log_softmax_take_the_cluster_path():
    k, strides = _kernel(LogSoftmax(), (1, 3, 40960))
    (cp, *_), _ = cluster_plans(k.graph, k.plans[0], strides)
    assert cp.rows and cp.channels == 3 and cp.stats.kind == "softmax"
    cuda, _ = emit_module(k.graph, k.plans[0], [cp])
    assert "logf(s_log_softmax_sum)" in cuda


def test_a_long_row_takes_the_moments_too():
    k, strides = _kernel(LongLayerNorm(), (5, 40960))
    (cp, *_), _ = cluster_plans(k.graph, k.plans[0], strides)
    assert cp.rows and cp.stats.kind == "moments" and cp.stats.var is not None and cp.plane * cp.n == 40960


class MaskedSoftmax(nn.Module):
    def forward(self, x, m):
        return torch.softmax(x + m, dim=-1)


@pytest.mark.parametrize("module,shapes,size,why", [
    (Softmax(), [(8, 4096)], 4, "a row of 4096 fits one program"),
    (Softmax(), [(2, 40000 + 4 * 3)], 8, "does not split over clusters of 8"),
    (MaskedSoftmax(), [(2, 65536), (2, 65536)], 4, "not taken over an expression of one input"),
    (PATTERNS["cross_entropy_like"].module(), None, 4, "target is torch.int64, not a float type"),
])
def test_rows_the_cluster_path_cannot_take_are_refused_with_the_reason(module, shapes, size, why):
    gen = torch.Generator().manual_seed(0)
    args = ([torch.randn(s, generator=gen) for s in shapes] if shapes else
            list(PATTERNS["cross_entropy_like"].make((4, 40000), torch.float32, "cpu", gen)))
    prog = stitchflow.compile(module, args, target="gpu", fusion="full")
    k = [k for run in prog._compiled for k in run.kernels][0]
    strides = {t: contiguous_strides(k.graph.type_of[t].shape) for t in k.inputs}
    with pytest.raises(ClusterRefusal, match=why):
        analyze(k.graph, k.plans[0], strides, size)


def test_functional_batch_norm_with_batch_statistics_lowers_to_the_cluster_path():
    args = _args(BN(), (16, 40, 28, 28), torch.bfloat16)
    prog = stitchflow.compile(_Functional(), args, target="gpu", fusion="full")
    (k,) = [k for run in prog._compiled for k in run.kernels]
    strides = {t: contiguous_strides(k.graph.type_of[t].shape) for t in k.inputs}
    plans, _ = cluster_plans(k.graph, k.plans[0], strides)
    assert plans and plans[0].stats.var is not None and len(plans[0].params) == 2


def test_low_precision_nodes_round_as_eager_does_and_streamed_inputs_load_in_the_epilogue():
    k, strides = _kernel(ResidualRelu(), (16, 40, 28, 28), torch.bfloat16)
    (cp, *_), _ = cluster_plans(k.graph, k.plans[0], strides)
    assert cp.streamed == ("r",) and len(cp.outputs) == 2
    cuda, _ = emit_module(k.graph, k.plans[0], [cp])
    assert "rnd_bf16(" in cuda and "Vec<__nv_bfloat16, VEC>*>(in_r)[off]" in cuda
    assert "fmaxf(" in cuda and cuda.count("reinterpret_cast<Vec<__nv_bfloat16, VEC>*>(out_") == 2


@pytest.mark.parametrize("module,shape,dtype,size,why", [
    (BN(), (6, 8, 5, 5), torch.float32, 2, "16-byte vectors"),
    (BN(), (6, 10, 4, 6), torch.float32, 8, "do not split over clusters of 8"),
    (BN(), (16, 4, 128, 128), torch.float32, 2, "exceeds 128 registers"),
    (PATTERNS["column_center"].module(), (256, 64), torch.float32, 2, "reduced axes"),
])
def test_parts_the_cluster_path_cannot_take_are_refused_with_the_reason(module, shape, dtype, size, why):
    args = (_args(module, shape, dtype) if not isinstance(module, PATTERNS["column_center"].module)
            else [torch.randn(shape)])
    prog = stitchflow.compile(module, args, target="gpu", fusion="full")
    (k,) = [k for run in prog._compiled for k in run.kernels]
    strides = {t: contiguous_strides(k.graph.type_of[t].shape) for t in k.inputs}
    with pytest.raises(ClusterRefusal, match=why):
        analyze(k.graph, k.plans[0], strides, size)


class TransposedResidual(nn.Module):
    def forward(self, x):
        return x - x.mean((0, 2, 3), keepdim=True) + x.transpose(2, 3)  # x read at (w, h): not x's own point


def test_reads_of_x_away_from_its_own_point_are_refused():
    k, strides = _kernel(TransposedResidual(), (8, 16, 4, 4))
    plans, why = cluster_plans(k.graph, k.plans[0], strides)
    assert plans == [] and "away from its own coordinates" in why[0]


def test_strided_inputs_and_other_reductions_are_refused():
    k, strides = _kernel(BN(), (8, 16, 4, 8))
    with pytest.raises(ClusterRefusal, match="not a contiguous"):
        analyze(k.graph, k.plans[0], {**strides, "x": (512, 1, 128, 16)}, 2)
    args = list(PATTERNS["rmsnorm_residual"].make((64, 96), torch.float32, "cpu", torch.Generator().manual_seed(0)))
    prog = stitchflow.compile(PATTERNS["rmsnorm_residual"].module(), args, target="gpu", fusion="full")
    (rk,) = [k for run in prog._compiled for k in run.kernels]
    plans, why = cluster_plans(rk.graph, rk.plans[0], {t: contiguous_strides(rk.graph.type_of[t].shape)
                                                         for t in rk.inputs})
    assert plans == [] and len(why) == len(cluster_planes.CLUSTERS)


def test_explain_lists_the_cluster_plans_of_each_part_or_why_none():
    args = _args(BN(), (16, 40, 28, 28), torch.float32)
    text = stitchflow.compile(BN(), args, target="gpu", fusion="full").explain()
    assert "plane and row statistics on thread-block clusters" in text and "cluster of 2 x 8 planes of 784" in text
    args = _args(BN(), (6, 8, 5, 5), torch.float32)
    text = stitchflow.compile(BN(), args, target="gpu", fusion="full").explain()
    assert "none: cluster of 8: 6 planes per channel do not split" in text and "16-byte vectors" in text


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="checks the interpreter's refusal; without the interpreter CPU tensors run through torch")
def test_pinning_clusters_without_a_gpu_says_why():
    module = BN()
    args = _args(module, (8, 16, 4, 8), torch.float32)
    prog = stitchflow.compile(module, args, target="gpu", fusion="full", options={"cluster": True})
    with pytest.raises(ValueError, match="cluster planes need a CUDA device"):
        prog(*args)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit) to compile for sm_90a")
def test_cluster_kernels_compile_for_sm90a_without_spills(tmp_path):
    for module, shape, dtype in MODULES:
        k, strides = _kernel(module(), shape, dtype)
        plans, _ = cluster_plans(k.graph, k.plans[0], strides)
        assert plans, (module, shape)
        cuda, _ = emit_module(k.graph, k.plans[0], plans[:2])
        src = tmp_path / "planes.cu"
        src.write_text(cuda)
        done = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "-Xptxas",
                               "-v", "-c", str(src), "-o", str(tmp_path / "planes.o")], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "spill stores" in done.stderr and " 0 bytes spill stores" in done.stderr
        assert all(" 0 bytes spill stores" in line for line in done.stderr.splitlines() if "spill stores" in line)


def _hopper_with_nvcc() -> bool:
    return (torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability()[0] >= 9 and cluster_planes.unavailable(torch.device("cuda")) is None)


@pytest.mark.skipif(not _hopper_with_nvcc(), reason="needs a Hopper GPU and nvcc (clusters, distributed shared memory)")
@pytest.mark.parametrize("module,shape,dtype", MODULES)
def test_every_cluster_size_equals_eager_on_hopper(module, shape, dtype):
    module = module()
    k, strides = _kernel(module, shape, dtype)
    plans, _ = cluster_plans(k.graph, k.plans[0], strides)
    for variant in range(min(2, len(plans))):
        launch = cluster_planes.ClusterLaunch(k.graph, k.plans[0], plans[:2], variant, "test",
                                              tempfile.mkdtemp(prefix="stitchflow-cuda-"))
        for seed in (0, 1):
            args = _args(module, shape, dtype, "cuda", seed)
            env = dict(zip(k.inputs, args))
            for _ in range(2):
                launch(env)
                for ref in as_tuple(module(*args)):  # each eager output is one of the kernel's
                    errors = [relative_error(env[name].reshape(ref.shape), ref) for name in plans[variant].outputs
                              if env[name].numel() == ref.numel()]  # group norm's output: the grouped view
                    assert min(errors) <= tolerance(dtype), (plans[variant], errors)


@pytest.mark.skipif(not _hopper_with_nvcc(), reason="needs a Hopper GPU and nvcc (clusters, distributed shared memory)")
def test_the_autotuner_times_clusters_against_the_generated_kernels_on_hopper():
    module = BN()
    args = _args(module, (32, 64, 28, 28), torch.float32, "cuda")
    prog = stitchflow.compile(module, args, target="gpu", fusion="full", options={"cuda_graphs": False})
    for o, r in zip(as_tuple(prog(*args)), as_tuple(module(*args))):
        assert relative_error(o, r) <= tolerance(torch.float32)
    (k,) = [k for run in prog._compiled for k in run.kernels]
    assert k.cluster_plans and k.chosen is not None
    rows = [torch.randn(12, 65536, device="cuda")]
    pinned = stitchflow.compile(Softmax(), rows, target="gpu", fusion="full", options={"cluster": True})
    assert relative_error(pinned(*rows), Softmax()(*rows)) <= tolerance(torch.float32)
    group_args = _args(GN(), (4, 64, 16, 16), torch.bfloat16, "cuda")
    pinned = stitchflow.compile(GN(), group_args, target="gpu", fusion="full", options={"cluster": True})
    assert relative_error(pinned(*group_args), GN()(*group_args)) <= tolerance(torch.bfloat16)
    for pinned_module in (module, _Functional()):  # the bench's formula, and F.batch_norm's lowering
        pinned = stitchflow.compile(pinned_module, args, target="gpu", fusion="full", options={"cluster": True})
        assert relative_error(as_tuple(pinned(*args))[0], module(*args)) <= tolerance(torch.float32)
        (pk,) = [k for run in pinned._compiled for k in run.kernels]
        assert pk.chosen[0].cluster and str(pk.chosen[0]).endswith("_K")


@pytest.mark.skipif(not _hopper_with_nvcc(), reason="needs a Hopper GPU and nvcc (clusters, distributed shared memory)")
def test_softmax_rows_with_infinite_and_nan_pieces_equal_eager_on_hopper():
    """A piece of only -inf sums its terms against 0 and is scaled by 0, not NaN; a NaN or +inf anywhere in a row
    makes the whole row NaN, as in torch; a row of only -inf is NaN."""
    x = torch.randn(6, 65536, device="cuda")
    x[0, :16384] = float("-inf")  # the first piece of clusters of 4 (two of clusters of 8)
    x[1, 5] = float("nan")
    x[2, 40000] = float("inf")
    x[3] = float("-inf")
    x[4, ::2] = float("-inf")
    x[5] *= 100  # most terms underflow against the row's maximum
    module = Softmax()
    k, strides = _kernel(module, tuple(x.shape))
    plans, _ = cluster_plans(k.graph, k.plans[0], strides)
    for variant in range(min(2, len(plans))):
        launch = cluster_planes.ClusterLaunch(k.graph, k.plans[0], plans[:2], variant, "test",
                                              tempfile.mkdtemp(prefix="stitchflow-cuda-"))
        env = {k.inputs[0]: x}
        launch(env)
        torch.testing.assert_close(env[plans[variant].outputs[0]], module(x), equal_nan=True, rtol=1e-5, atol=1e-6)

