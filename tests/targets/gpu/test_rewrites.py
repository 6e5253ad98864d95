"""One-hot select-sums become gathers and sums of a few terms additions (gpu target rewrites),
and online sums stay finite on rows that start with -inf; every case checked against eager under
TRITON_INTERPRET=1."""

import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("STITCHFLOW_CACHE", tempfile.mkdtemp(prefix="stitchflow-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import stitchflow  # noqa: E402
from stitchflow.bench.stitching_patterns import PATTERNS, relative_error  # noqa: E402
from stitchflow.ir.expr import Cast  # noqa: E402
from stitchflow.ir.interpret import run_graph  # noqa: E402
from stitchflow.targets.gpu.grouping import fold_iotas  # noqa: E402
from stitchflow.targets.gpu.rewrites import (SMALL_SUM, gather_one_hots, sink_widening_casts,  # noqa: E402
                                             unroll_small_sums)
from conftest import assert_close  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests on CPU tensors: a GPU session (TRITON_INTERPRET=0) "
                                "runs the device tests (test_coop_*, test_chain_hopper, ...) instead")


def _rewritten(prog):
    return gather_one_hots(fold_iotas(prog.graph, prog.captured.param_values))


def _same_as_before(prog, *args):
    """The rewritten graph computes bit for bit what the captured one does (reference
    interpreter, same inputs): the select-sum only ever added exact zeros."""
    outs = []
    for graph in (prog.graph, _rewritten(prog)):
        env = dict(prog.captured.param_values) | dict(zip(prog.graph.inputs, args))
        outs.append(run_graph(graph, env)[graph.outputs[0]])
    return torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cross_entropy_select_sum_becomes_one_gather(dtype):
    module = PATTERNS["cross_entropy_like"].module()
    logits, target = PATTERNS["cross_entropy_like"].make((6, 37), dtype, "cpu", torch.Generator().manual_seed(0))
    target[0], target[1] = -2, 37  # out of range: eager's select-sum picks nothing there (0)
    prog = stitchflow.compile(module, (logits, target), target="gpu", fusion="full")
    graph = _rewritten(prog)
    sums = [n for n in graph.nodes if n.reduce == "sum"]
    assert len(sums) == 1 and "exp" in str(sums[0])  # only the log-softmax's row sum still reduces
    assert not any("where" in n.name or n.name.startswith("eq") for n in graph.nodes)  # dead nodes dropped
    assert any("target[i]" in str(n.body) for n in graph.nodes)  # the logit is gathered
    assert _same_as_before(prog, logits, target)
    out = prog(logits, target)
    assert relative_error(out, module(logits, target)) < (1e-6 if dtype == torch.float32 else 1e-5)
    assert out[:2].eq(0.0).all()


class SelectSumVariants(nn.Module):
    """Condition with an extra conjunct, iota on the left, an int32 target widened to int64, a
    selected value that is itself elementwise over two inputs."""

    def forward(self, x, y, t, keep):
        iota = torch.arange(x.shape[-1])
        picked = torch.where((iota[None, :] == t.long()[:, None]) & keep[:, None], x * y + 1.0, 0.0).sum(-1)
        return picked * 2.0


def test_select_sum_variants_equal_eager():
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(9, 21, generator=gen), torch.randn(9, 21, generator=gen)
    t = torch.randint(-1, 22, (9,), generator=gen).to(torch.int32)
    keep = torch.rand(9, generator=gen) < 0.7
    module = SelectSumVariants()
    prog = stitchflow.compile(module, (x, y, t, keep), target="gpu", fusion="full")
    assert not any(n.reduce for n in _rewritten(prog).nodes)
    assert _same_as_before(prog, x, y, t, keep)
    assert relative_error(prog(x, y, t, keep), module(x, y, t, keep)) < 1e-6


class NotOneHot(nn.Module):
    """`<=` is no one-hot: a prefix sum over the row, which must stay a reduction."""

    def forward(self, x, t):
        iota = torch.arange(x.shape[-1])
        return torch.where(iota[None, :] <= t[:, None], x, 0.0).sum(-1)


def test_other_selects_stay_reductions():
    x, t = torch.randn(5, 13), torch.randint(0, 13, (5,))
    prog = stitchflow.compile(NotOneHot(), (x, t), target="gpu", fusion="full")
    assert any(n.reduce == "sum" for n in _rewritten(prog).nodes)
    assert relative_error(prog(x, t), NotOneHot()(x, t)) < 1e-6


class MaskedLongSoftmax(nn.Module):
    def forward(self, s, keep):
        return torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)


@pytest.mark.parametrize("block_l", [16, 64])
def test_online_softmax_rows_starting_with_minus_inf(block_l):
    """Chunks of a row that hold only -inf (a causal mask's tail, read first) must not make
    exp(-inf - -inf) = NaN poison the running sum."""
    s = torch.randn(6, 200)
    keep = torch.ones(6, 200, dtype=torch.bool)
    keep[:, :100] = False  # the first chunks of every row are fully masked
    keep[3, 150:] = False
    module = MaskedLongSoftmax()
    prog = stitchflow.compile(module, (s, keep), target="gpu", fusion="full", options={"block_l": block_l})
    out = prog(s, keep)
    assert not torch.isnan(out).any()
    assert relative_error(out, module(s, keep)) < 1e-6


def test_full_chunks_run_unmasked_and_the_tail_once(monkeypatch):
    """A row of 1000 in chunks of 64: 15 full chunks without the range test, then one masked
    chunk; the answer is eager's."""
    import stitchflow.targets.gpu.runtime as runtime

    sources = []
    build = runtime.build_kernel
    monkeypatch.setattr(runtime, "build_kernel", lambda *a, **k: sources.append(build(*a, **k).source) or build(*a, **k))
    module = PATTERNS["softmax_64x30000"].module()
    (x,) = PATTERNS["softmax_64x30000"].make((3, 1000), torch.float32, "cpu", torch.Generator().manual_seed(0))
    prog = stitchflow.compile(module, (x,), target="gpu", fusion="full", options={"block_l": 64})
    assert relative_error(prog(x), module(x)) < 1e-6
    body = sources[0].split("def _part0")[1]
    assert "for l0 in range(lo, 960, 64):" in body and "for l0 in range(960, hi, 64):" in body
    full_loop = body.split("for l0 in range(lo, 960, 64):")[1].split("for l0 in range(960, hi, 64):")[0]
    assert "mask_l" not in full_loop


class GroupedKeyGradient(nn.Module):
    """A GQA key gradient as a Llama step's backward meets it: the transposed per-head gradient
    (h, d, t) summed over each group's query heads, then RoPE's backward multiplies (t, d)."""

    def __init__(self, group: int):
        super().__init__()
        self.group = group

    def forward(self, dkt, cos, sin):
        b, h, d, t = dkt.shape
        dk = dkt.view(b, h // self.group, self.group, d, t).sum(2).transpose(-1, -2)
        return dk * cos, dk * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group,tokens", [(4, 37), (2, 64), (SMALL_SUM * 2, 33)])
def test_small_sums_become_additions_with_a_transposed_mapping(dtype, group, tokens):
    """A sum over `group` <= SMALL_SUM heads becomes one elementwise part whose tiles transpose
    (both the transposed read and the outputs stay coalesced); a larger group stays a reduction."""
    gen = torch.Generator().manual_seed(6)
    dkt = torch.randn(1, 2 * group, 16, tokens, generator=gen).to(dtype)
    cos, sin = (torch.randn(tokens, 16, generator=gen).to(dtype) for _ in range(2))
    module = GroupedKeyGradient(group)
    prog = stitchflow.compile(module, (dkt, cos, sin), target="gpu", fusion="full")
    graph = unroll_small_sums(prog.graph)
    unrolled = group <= SMALL_SUM
    assert any(n.reduce == "sum" for n in graph.nodes) != unrolled
    outs = prog(dkt, cos, sin)
    for out, ref in zip(outs, module(dkt, cos, sin)):
        assert_close(out, ref)
    (kernel,) = [k for run in prog._compiled for k in run.kernels]
    assert kernel.plans[0].transposed == unrolled


def test_sums_that_stay_reductions():
    """GEMM-like products (library GEMMs) and integer sums are left alone; a float sum of five
    terms is unrolled."""
    x, w = torch.randn(5, 3), torch.randn(3, 4)
    for fn, args, sums_left in ((lambda a, b: a @ b, (x, w), 1),
                                (lambda a: a.sum(-1), (torch.arange(15).view(5, 3),), 1),
                                (lambda a: a.sum(0), (x,), 0)):
        prog = stitchflow.compile(fn, args, target="gpu")
        assert sum(n.reduce == "sum" for n in unroll_small_sums(prog.graph).nodes) == sums_left


class Pools(nn.Module):
    """ResNet's stem pool with its indices and a 2x2 tiling max pool of x, and a stride-1 average
    pool (count_include_pad off) of y, channels last as a CNN's activations are."""

    def forward(self, x, y):
        peak, index = torch.nn.functional.max_pool2d(x, 3, 2, 1, return_indices=True)
        mean = torch.nn.functional.avg_pool2d(y, 3, 1, 1, count_include_pad=False)
        return peak, index, mean, torch.nn.functional.max_pool2d(x, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 5, 11, 9), (1, 16, 8, 8)])
def test_sliding_windows_become_elementwise(dtype, shape):
    """Pools over overlapping windows (3x3, stride 2 or 1) are unrolled into elementwise maxima and
    sums (the sum's input read by it alone), each tap one read, and agree with eager, a NaN kept where
    torch keeps it; a tiling pool (windows that do not overlap) stays a reduction."""
    x, y = (torch.randn(shape).to(dtype).contiguous(memory_format=torch.channels_last) for _ in range(2))
    x[0, 1, 2, 3] = y[0, 1, 2, 3] = float("nan")
    module = Pools()
    prog = stitchflow.compile(module, (x, y), target="gpu", fusion="full")
    graph = unroll_small_sums(prog.graph)
    kept = [n for n in graph.nodes if n.reduce and n.reduce_vars]
    assert len(kept) == 1 and kept[0].reduce == "max", [str(n) for n in kept]
    for out, ref in zip(prog(x, y), module(x, y)):
        assert_close(out, ref)


def test_a_max_pools_gradient_is_unrolled():
    """The gradient of an overlapping max pool gathers the windows that hold each input point: unrolled
    into taps, each a coalesced read, whether the incoming gradient is an input or computed in the
    same kernel (two gradients added)."""
    g1, g2 = torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3)
    x = torch.randn(2, 4, 6, 6)
    _, index = torch.nn.functional.max_pool2d(x, 3, 2, 1, return_indices=True)

    for fn, args in ((_pool_gradient, (g1, x, index)),
                     (lambda a, b, x, index: _pool_gradient(a + b, x, index), (g1, g2, x, index))):
        prog = stitchflow.compile(fn, args, target="gpu", fusion="full")
        assert not any(n.reduce for n in unroll_small_sums(prog.graph).nodes)
        assert_close(prog(*args), fn(*args))


def test_unrolled_taps_are_stored_before_a_kernel_that_needs_them_twice():
    """A batch norm backward after the pool's gradient needs it in two passes (its sums, then its
    outputs): the unrolled taps end their kernel and are stored, rather than gathered again in each
    pass; a consumer that needs them once takes them in."""
    g1, g2 = torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3)
    x = torch.randn(2, 4, 6, 6)
    _, index = torch.nn.functional.max_pool2d(x, 3, 2, 1, return_indices=True)

    def centred(a, b, x, index):
        g = torch.relu(_pool_gradient(a + b, x, index))
        return g - g.mean(dim=(0, 2, 3), keepdim=True)

    def scaled(a, b, x, index):
        return torch.relu(_pool_gradient(a + b, x, index)) * 2

    for fn, kernels in ((centred, 2), (scaled, 1)):
        args = (g1, g2, x, index)
        prog = stitchflow.compile(fn, args, target="gpu", fusion="full")
        launched = [k for run in prog._compiled for k in run.kernels]
        assert len(launched) == kernels, [k.title for k in launched]
        assert_close(prog(*args), fn(*args))


def test_masked_gathers_load_clamped_addresses():
    """A ceil-mode max-pool gradient gathers at w // 2 under the tile's mask: the generated loads
    take clamped, in-bounds addresses with the value masked (Triton 3.6 read such a masked load with
    its neighbour's mask at one or two warps on an H100), and the result equals eager's."""
    x = torch.randn(2, 3, 8, 7)
    _, idx = torch.nn.functional.max_pool2d_with_indices(x, 2, ceil_mode=True)
    g = torch.randn(2, 3, 4, 4)

    def backward(g, x, idx):
        return torch.ops.aten.max_pool2d_with_indices_backward(g, x, [2, 2], [2, 2], [0, 0], [1, 1], True, idx)
    prog = stitchflow.compile(backward, (g, x, idx), target="gpu", fusion="full")
    assert torch.equal(prog(g, x, idx), backward(g, x, idx))
    (kernel,) = [k for run in prog._compiled for k in run.kernels]
    (launch,) = kernel._built.values()
    loads = [line for line in launch.spec.source.splitlines() if "tl.load(" in line]
    assert loads and all("tl.minimum(tl.maximum(" in line and "mask=" not in line for line in loads), loads


def test_gathers_without_a_tail_clamp_each_index():
    """Where no lane of the tile lies past the iteration space, a gathered tap clamps each index into its
    dimension instead of the whole address, so the coordinate that walks the tensor contiguously stays
    outside any clamp and the loads stay vectorized (ResNet-18's unrolled stem pool gradient: 662 µs
    with whole addresses clamped, 130 µs with each index, H100)."""
    x = torch.randn(2, 4, 8, 8)
    _, index = torch.nn.functional.max_pool2d(x, 3, 2, 1, return_indices=True)
    g = torch.randn(2, 4, 4, 4)
    prog = stitchflow.compile(_pool_gradient, (g, x, index), target="gpu", fusion="full")
    assert torch.equal(prog(g, x, index), _pool_gradient(g, x, index))
    (kernel,) = [k for run in prog._compiled for k in run.kernels]
    (launch,) = kernel._built.values()
    loads = [line for line in launch.spec.source.splitlines() if "tl.load(" in line and "//" in line]
    assert len(loads) == 8 and not any("tl.minimum(tl.maximum(" in line for line in loads), loads


def _pool_gradient(g, x, index):
    return torch.ops.aten.max_pool2d_with_indices_backward(g, x, [3, 3], [2, 2], [1, 1], [1, 1], False, index)


def test_a_widening_cast_between_kernels_is_stored_narrow():
    """ResNet's stem backward: a max pool's gradient (bfloat16, gathered in its own kernel) is cast
    to float32 for the batch norm backward's per-channel sums in another kernel. The cast moves into
    its readers, so the bfloat16 gradient is what crosses between the kernels; values equal eager's."""
    a, b = (torch.randn(2, 4, 5, 5).to(torch.bfloat16) for _ in range(2))
    x = torch.randn(2, 4, 9, 9).to(torch.bfloat16)
    _, index = torch.nn.functional.max_pool2d(x, 3, 2, 1, return_indices=True)

    def stem_backward(a, b, x, index):
        g = torch.where(x > 0, _pool_gradient(a + b, x, index), 0).float()
        total = g.sum((0, 2, 3), keepdim=True)
        return ((g - total / 162) * x.float()).to(torch.bfloat16), total

    args = (a, b, x, index)
    prog = stitchflow.compile(stem_backward, args, target="gpu", fusion="full")
    sunk = sink_widening_casts(prog.graph)
    assert sunk is not prog.graph and any("float32(" in str(n.body) and n.reduce == "sum" for n in sunk.nodes)
    out = prog(*args)
    stored = {o for run in prog._compiled for k in run.kernels for p in k.plans for o in p.outputs}
    full = [o for o in stored if prog.graph.type_of[o].shape == (2, 4, 9, 9)]
    assert full and all(prog.graph.type_of[o].dtype == torch.bfloat16 for o in full), full
    for got, want in zip(out, stem_backward(*args)):  # sums of bfloat16 values: bfloat16's tolerance
        assert_close(got, want, torch.bfloat16)


def test_casts_read_by_products_or_outputs_stay():
    """A cast a GEMM reads (of a computed value, of an input) and a cast the program returns stay nodes."""
    w = torch.randn(6, 5).to(torch.bfloat16)

    def casts(x, w):
        h = torch.relu(x).float()
        return h @ w.float(), torch.tanh(x).float()

    prog = stitchflow.compile(casts, (torch.randn(4, 6).to(torch.bfloat16), w), target="gpu", fusion="full")
    assert sink_widening_casts(prog.graph) is prog.graph


def test_a_cast_of_an_input_sinks_into_its_readers():
    """float32(x) of a bfloat16 input, read by a sum and by a later elementwise node: both read x
    through the cast, so a kernel boundary between them carries x (stored already), not a float32 copy
    (a group norm gradient's activations: 8 MB instead of 4 at a U-Net's top level)."""
    def f(x):
        xf = x.float()
        return xf.sum(1), torch.exp(xf) * 2

    x = torch.randn(4, 6).to(torch.bfloat16)
    prog = stitchflow.compile(f, (x,), target="gpu", fusion="full")
    sunk = sink_widening_casts(prog.graph)
    cast = next(n.name for n in prog.graph.nodes if isinstance(n.body, Cast))
    readers = [n for n in sunk.nodes if n.name in prog.graph.consumers[cast]]
    assert readers and all(cast not in n.inputs and prog.graph.inputs[0] in n.inputs for n in readers)
    for out, ref in zip(prog(x), f(x)):
        torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("rows, exact", [(torch.arange(16) // 2, True), (torch.arange(16) % 8, False)],
                         ids=["blocks", "wrapped"])
def test_a_scatter_add_over_constant_blocks_becomes_a_sum_of_windows(rows, exact):
    """out[.., r[l], r[m]] += g[.., l, m]: with r = arange(16) // 2 (nearest upsampling's gradient) each
    output sums its own 2 x 2 window, in one kernel and no torch scatter; with any other constant (a wrap
    that sends rows 0 and 8 to one output) the scatter stays, and both equal eager."""
    def scatter(g):
        r = (torch.arange(16, device=g.device) // 2) if exact else (torch.arange(16, device=g.device) % 8)
        out = torch.zeros(2, 3, 8, 8, device=g.device)
        return torch.ops.aten.index_put(out, [None, None, r[:, None], r[None, :]], g, True)

    g = torch.randn(2, 3, 16, 16)
    prog = stitchflow.compile(scatter, (g,), target="gpu", fusion="full")
    assert_close(prog(g), scatter(g))
    torch_steps = [s for run in prog._compiled for s in run.steps if type(s).__name__ == "TorchStep"]
    assert bool(torch_steps) != exact, torch_steps
