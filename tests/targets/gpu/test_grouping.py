"""Kernel boundaries of the gpu target's grouping (targets/gpu/grouping.py): elementwise work that a
kernel makes only for one later kernel moves into it (`defer_elementwise`)."""

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import stitchflow  # noqa: E402
from stitchflow.targets.gpu.grouping import defer_elementwise, plan_group  # noqa: E402
from stitchflow.targets.gpu.mapping import candidates, programs  # noqa: E402


def _two_kernels(fn, args, first: int):
    """The program's nodes cut into two kernels after the `first` ones, as greedy grouping can leave them."""
    graph = stitchflow.compile(fn, args, target="gpu", fusion="full").graph
    nodes = list(graph.nodes)
    steps = [("kernel", part, plan_group(graph, part, set())) for part in (nodes[:first], nodes[first:])]
    return graph, steps


def test_a_centred_input_moves_into_the_kernel_that_reads_it():
    """x - mean in float32, of a bfloat16 x, read only by the next kernel: computed there from x (half
    the bytes of the float32 value), not stored."""
    x, mean = torch.randn(64, 24).to(torch.bfloat16), torch.randn(24)

    def centred_square_sums(x, mean):
        centred = x.float() - mean
        return (centred * centred).sum(0)

    graph, steps = _two_kernels(centred_square_sums, (x, mean), first=2)
    (kernel,) = defer_elementwise(graph, steps)
    assert [n.name for n in kernel[1]] == [n.name for n in graph.nodes]
    stored = {o for plan in kernel[2] for o in plan.outputs}
    assert stored == set(graph.outputs)


def test_work_read_elsewhere_or_costing_more_bytes_stays():
    """Not moved: a value the program returns (it is stored anyway), and one whose inputs are more bytes
    than itself (three float32 tensors summed: the later kernel would read three tensors for one)."""
    a, b, c = (torch.randn(32, 16) for _ in range(3))

    def returned(a, b, c):
        total = a + b
        return total, (total * c).sum(1)

    def wide_inputs(a, b, c):
        total = a + b + c
        return (total * total).sum(1)

    for fn, first in ((returned, 1), (wide_inputs, 2)):
        graph, steps = _two_kernels(fn, (a, b, c), first=first)
        assert defer_elementwise(graph, steps) == steps, fn.__name__


def test_work_made_from_a_value_stored_anyway_moves():
    """A group norm gradient's product in small: float32(a) * float32(y), with a = bfloat16(...) stored by
    the first kernel for a reader of its own; the product, read only by the next kernel's sum, is
    computed there from a and y (bfloat16) rather than stored in float32."""
    x, y = torch.randn(64, 24).to(torch.bfloat16), torch.randn(64, 24).to(torch.bfloat16)

    def product_sums(x, y):
        a = torch.tanh(x.float()).to(torch.bfloat16)
        return a, (a.float() * y.float()).sum(0)

    graph, steps = _two_kernels(product_sums, (x, y), first=6)  # ..., to, float32(to), float32(y), mul | sum
    first, second = defer_elementwise(graph, steps)
    assert {o for plan in first[2] for o in plan.outputs} == {"to"}
    assert "mul" in {n.name for n in second[1]}


def _pool_gradient(g, x, index):
    return torch.ops.aten.max_pool2d_with_indices_backward(g, x, [3, 3], [2, 2], [1, 1], [1, 1], False, index)


def test_each_piece_moves_on_its_own_bytes():
    """A ResNet stem's backward in small: the batch norm backward needs the max pool's gradient (window
    taps, kept out of it and stored: `recomputed_stencils`) and its centred input in two passes. Greedy
    order leaves both before it; the centred input (x - mean from a bfloat16 x) moves in, the taps
    (more bytes of inputs than their value) stay, and the result equals eager."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 6, 6, dtype=torch.bfloat16)
    _, index = torch.nn.functional.max_pool2d(x, 3, 2, 1, return_indices=True)
    a, b = torch.randn(2, 4, 3, 3, dtype=torch.bfloat16), torch.randn(2, 4, 3, 3, dtype=torch.bfloat16)
    y, mean = torch.randn(2, 4, 6, 6, dtype=torch.bfloat16), torch.randn(1, 4, 1, 1)

    def batch_norm_backward_like(a, b, x, index, y, mean):
        centred = y.float() - mean
        g = torch.where(x <= 0, 0, _pool_gradient(a + b, x, index)).float()
        return g - g.sum(dim=(0, 2, 3), keepdim=True) - (g * centred).sum(dim=(0, 2, 3), keepdim=True) * centred

    args = (a, b, x, index, y, mean)
    prog = stitchflow.compile(batch_norm_backward_like, args, target="gpu", fusion="full")
    kernels = [k for run in prog._compiled for k in run.kernels]
    assert len(kernels) == 2, [k.title for k in kernels]
    # the first kernel stores the gradient alone (in bfloat16: its widening cast sinks), not y - mean
    (taps,) = [o for plan in kernels[0].plans for o in plan.outputs]
    assert prog.graph.type_of[taps].dtype == torch.bfloat16 and not any(n.reduce for n in kernels[0].plans[0].nodes)
    exact = batch_norm_backward_like(*(t.double() if t.is_floating_point() else t for t in args))
    rms = lambda t: (t.double() - exact).pow(2).mean().sqrt()  # noqa: E731  (both round g to bfloat16)
    assert rms(prog(*args)) <= 2 * rms(batch_norm_backward_like(*args)) + 1e-3


def test_long_reductions_over_few_rows_are_not_packed():
    """Two independent channel sums over 32 x 32 positions of 8 images (a U-Net's group-norm gradient
    sums, channels last): packed into one launch neither could split its positions over programs, so
    each gets a kernel of its own; over 4 x 4 positions they still share one."""
    def two_sums(a, b):
        return a.float().sum(dim=(1, 2)), (b.float() * 2).sum(dim=(1, 2))

    for side, kernels in ((32, 2), (4, 1)):
        a, b = (torch.randn(8, side, side, 16, dtype=torch.bfloat16) for _ in range(2))
        prog = stitchflow.compile(two_sums, (a, b), target="gpu", fusion="full")
        launched = [k for run in prog._compiled for k in run.kernels]
        assert len(launched) == kernels, [k.title for k in launched]
        for out, ref in zip(prog(a, b), two_sums(a, b)):
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)  # float32 sums of 1024 in other orders


def test_packed_channel_sums_fill_the_device():
    """Channel sums over 16 x 16 positions of 8 images with 256 channels stay packed in one launch;
    unsplit, their column tiles narrow until the 2048 channels fill two waves of an H100's programs
    (the wide tiles left 16 programs)."""
    def two_sums(a, b):
        return a.float().sum(dim=(1, 2)), (b.float() * 2).sum(dim=(1, 2))

    a, b = (torch.randn(8, 16, 16, 256, dtype=torch.bfloat16) for _ in range(2))
    prog = stitchflow.compile(two_sums, (a, b), target="gpu", fusion="full")
    outs = prog(a, b)
    (kernel,) = [k for run in prog._compiled for k in run.kernels]
    assert kernel.packed
    reductions = [(p, c) for p, c in zip(kernel.plans, kernel.chosen) if p.reductions]
    assert len(reductions) == 2
    for plan, cfg in reductions:
        assert cfg.split == 1 and programs(plan, cfg) >= 128, cfg
        assert cfg.BP * 2 >= 32, cfg  # no narrower than a 32-byte sector of bfloat16
    for out, ref in zip(outs, two_sums(a, b)):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("pins", [{}, {"block_p": 64, "block_l": 64, "split": 4}])
def test_a_reduction_across_layouts_may_take_square_tiles(pins):
    """A channel sum over an NCHW value made from an NHWC tensor (a convolution's bias gradient from
    channels-last activations): the part's large tensors disagree on the contiguous axis, so its
    autotuning space holds square tiles beside the row configs, and they compute the same sums."""
    def f(x):
        y = x.permute(0, 3, 1, 2) * 2
        return y, y.float().sum(dim=(0, 2, 3))

    x = torch.randn(3, 9, 10, 37, dtype=torch.bfloat16)
    prog = stitchflow.compile(f, (x,), target="gpu", fusion="full", options=pins)
    (kernel,) = [k for run in prog._compiled for k in run.kernels]
    (plan,) = [p for p in kernel.plans if p.reductions]
    assert plan.crossed and not plan.p_contiguous
    assert any(c.BP == 64 and c.BL == 64 for c in candidates(plan)), candidates(plan)
    for out, ref in zip(prog(x), f(x)):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def _rotary(q, k, positions):
    """Q over 4 heads and K over 2, turned by cos/sin tables computed in the graph over (position, feature), the
    tables also returned (as transformers' Llama computes them once and every layer reads them)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def turn(x):
        half = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
        return x * cos + half * sin
    return turn(q), turn(k), cos, sin


def test_tables_read_by_q_and_k_heads_are_not_a_cross_product():
    """Q's heads and K's heads are different axes: one loop nest over both evaluated (and stored) every node once
    per head of the other. The tables run in a nest of their own and each of Q and K recomputes them."""
    from stitchflow.targets.gpu.runtime import GroupKernel

    q, k, positions = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.arange(6)
    prog = stitchflow.compile(_rotary, (q, k, positions), target="gpu", fusion="full")
    for got, want in zip(prog(q, k, positions), _rotary(q, k, positions)):
        torch.testing.assert_close(got, want)
    graph = prog.graph
    plans = [p for run in prog.compiled for s in run.steps if isinstance(s, GroupKernel) for p in s.plans]
    for plan in plans:  # every part's nest is no larger than the largest value it stores
        if plan.outputs:
            largest = max(math.prod(graph.type_of[o].shape) for o in plan.outputs)
            assert plan.P_total * plan.L_total <= largest, [n.name for n in plan.nodes]


def test_merging_flows_into_a_loop_nest_plans_each_candidate_once(monkeypatch):
    """Maps of one input (each its own data-flow component) join one loop nest: each join plans the merged nest
    once. It planned the part it joined again for every node of the merge too, cubic in the flows: a Mamba
    backward's 516-node region took 656 s to group on the CPU, 28 s since."""
    from stitchflow.targets.gpu import analysis

    x = torch.randn(6, 10)
    maps = 24
    graph = stitchflow.compile(lambda x: tuple(x * (k + 2.0) for k in range(maps)), (x,), target="gpu",
                               fusion="full").graph
    calls = []
    spread = analysis._spread
    monkeypatch.setattr(analysis, "_spread", lambda *a: calls.append(1) or spread(*a))
    (plan,) = plan_group(graph, list(graph.nodes), set())
    assert len(plan.nodes) == maps and set(plan.outputs) == set(graph.outputs)
    assert len(calls) <= 3 * maps  # each flow alone (twice: _uncrossed), and merged with the nest so far
