"""How the backend partitions a graph when capture refuses a node it could not judge ahead (a lowering's refusal
on these arguments, a bug of ours at one node), and constants with no elements (a key/value cache's first
`torch.tensor([])`), which once sent whole partitions, Hugging Face's causal LMs among them, to eager."""

import sys

import pytest
import torch
import torch.nn as nn

import stitchflow.backend as backend
from conftest import assert_close
from stitchflow.backend_layouts import _dense_layout, restrided


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _masked_index_put(x, idx, v):
    a = x.exp() * 2
    # has a lowering, refused at capture: a boolean mask after a whole dim
    b = torch.ops.aten.index_put(a, [None, a[0] > idx.float()], v)
    return (b + 1).softmax(-1) + a.sum(0)


def test_a_node_refused_at_capture_runs_eagerly_and_the_rest_compiles_around_it():
    x, idx, v = torch.randn(6, 5), torch.tensor(1), torch.tensor(-1.0)
    compiled = torch.compile(_masked_index_put, backend="stitchflow")
    for _ in range(2):
        assert_close(compiled(x, idx, v), _masked_index_put(x, idx, v))
    report = backend.fallback_report()
    assert "a boolean mask index among others" in report and "the rest of the partition compiles around it" in report
    assert backend.regions_executed() >= 2  # the exp and scaling before it, the softmax after it
    assert len(backend.COMPILED) >= 3  # the partition that refused, and the parts it was split into


def test_an_internal_error_at_one_node_costs_only_that_node(monkeypatch):
    """A bug in one lowering sends its node to eager; the nodes around it still compile."""
    from stitchflow.frontend import ops_elementwise
    from stitchflow.frontend.registry import LOWERINGS

    def broken(*args, **kwargs):
        raise RuntimeError("a lowering bug")

    key = next(k for k, fn in LOWERINGS.items() if fn is LOWERINGS.get(torch.sigmoid))
    monkeypatch.setitem(LOWERINGS, key, broken)
    assert ops_elementwise  # (the registry is filled on import)
    f = lambda x: (torch.sigmoid(x.exp() * 2) + 1).softmax(-1)  # noqa: E731
    x = torch.randn(4, 6)
    assert_close(torch.compile(f, backend="stitchflow")(x), f(x))
    report = backend.fallback_report()
    assert "internal error, RuntimeError: a lowering bug" in report and "compiles around it" in report
    assert backend.regions_executed() >= 2


def test_an_empty_constant_joins_a_concatenation_as_torch_skips_it():
    """A DynamicCache starts each layer's keys as torch.tensor([]) and concatenates the new keys to it."""
    def f(x):
        keys = torch.cat([torch.tensor([], dtype=x.dtype), x.relu() * 2], dim=-2)
        return keys.softmax(-1)

    x = torch.randn(2, 3, 8, 4)
    assert_close(torch.compile(f, backend="stitchflow")(x), f(x))
    assert backend.FALLBACKS == []
    assert backend.regions_executed() >= 1


class CachedProjection(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        keys = torch.cat([torch.tensor([], dtype=x.dtype), self.proj(x)], dim=-2)
        return (keys.softmax(-1) * x).sum()


def test_an_empty_constant_lifted_by_autograd_stays_a_constant_of_its_partition():
    """AOTAutograd lifts torch.tensor([]) to a constant of the forward graph, which splitting handed to the
    partition as an input with no elements: the whole forward ran eagerly."""
    torch.manual_seed(0)
    model, x = CachedProjection(), torch.randn(2, 3, 5, 4)
    expected = model(x)
    expected.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    got = torch.compile(model, backend="stitchflow")(x)
    got.backward()
    assert_close(got, expected)
    for p, g in zip(model.parameters(), want):
        assert_close(p.grad, g)
    assert backend.FALLBACKS == []


def _scan_with_an_empty_tail(x, steps: int):
    """transformers' Mamba scan path: tensor_split at the sequence length leaves an empty tail, and each of the
    tail's ops (none of which matters) once refused capture in turn, one nested split per op."""
    head, tail = torch.tensor_split(x, [x.shape[-1]], dim=-1)
    y = (head.exp() * 2).softmax(-1)
    for _ in range(steps):
        tail = (tail * 2 + 1).sigmoid()
    return torch.cat([y, tail], dim=-1) + 1


def test_tensors_with_no_elements_fold_to_constants():
    x = torch.randn(3, 8)
    f = lambda x: _scan_with_an_empty_tail(x, 120)  # noqa: E731 - past the recursion limit, one split a level
    assert_close(torch.compile(f, backend="stitchflow")(x), f(x))
    assert backend.FALLBACKS == []  # the split too: nothing reads its empty piece once the tail's ops fold
    assert backend.regions_executed() >= 1


def test_a_training_step_through_an_empty_tail_folds_both_graphs():
    x = torch.randn(3, 8, requires_grad=True)
    f = lambda x: _scan_with_an_empty_tail(x, 4).square().sum()  # noqa: E731
    f(x).backward()
    want, x.grad = x.grad, None
    loss = torch.compile(f, backend="stitchflow")(x)
    loss.backward()
    assert_close(loss, f(x))
    assert_close(x.grad, want)
    assert backend.FALLBACKS == []


def test_an_empty_graph_output_is_made_eagerly_each_call():
    """A constant would hand the caller the same tensor every call (resize_ on it would change the next)."""
    def f(x):
        y, tail = _scan_with_an_empty_tail(x, 2), torch.tensor_split(x, [x.shape[-1]], dim=-1)[1]
        return y, tail * 2

    x = torch.randn(3, 8)
    compiled = torch.compile(f, backend="stitchflow")
    first, second = compiled(x)[1], compiled(x)[1]
    assert first.shape == (3, 0) and first is not second
    for got, want in zip(compiled(x), f(x)):
        assert_close(got, want)
    assert "no elements" in backend.fallback_report()


def _masked_chain(x, v, steps: int):
    for _ in range(steps):  # each masked index_put refused at capture, found only once the graph before it captures
        y = (x * 2).sigmoid()
        x = torch.ops.aten.index_put(y, [None, y[0] > 0.6], v)  # a mask after a whole dim
    return x.softmax(-1)


def _stack_depth() -> int:
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return depth


@pytest.mark.parametrize("training", [False, True])
def test_refusals_found_one_at_a_time_split_without_nesting_calls(monkeypatch, training):
    """Each refusal splits the part after it again; that split's nodes take the part's place in the graph being
    run, so compiles happen at one call depth however many refusals a chain has (nested, each took ~15 frames)."""
    depths = []
    compile_ = backend.StitchflowModule._compile

    def recording(self, args):
        depths.append(_stack_depth())
        return compile_(self, args)

    monkeypatch.setattr(backend.StitchflowModule, "_compile", recording)
    lookups = []
    call_for = backend.StitchflowModule._call_for
    monkeypatch.setattr(backend.StitchflowModule, "_call_for",
                        lambda self, args: lookups.append(self) or call_for(self, args))
    x, v = torch.randn(6, 5, requires_grad=training), torch.tensor(0.25)
    f = lambda x, v: _masked_chain(x, v, 12)  # noqa: E731
    compiled = torch.compile(f, backend="stitchflow")
    for step in range(2):
        lookups.clear()
        got, expected = compiled(x, v), f(x, v)
        assert_close(got, expected)
        if training:
            (gx,) = torch.autograd.grad(got.square().sum(), x)
            (ex,) = torch.autograd.grad(expected.square().sum(), x)
            assert_close(gx, ex)
        if step and not training:  # each partition's signature looked up once per call, split or not
            assert len(lookups) == len(set(map(id, lookups)))
    assert backend.fallback_report().count("compiles around it") >= 12
    assert len(depths) >= 24 and max(depths) - min(depths) <= 6  # (partitions Dynamo calls, and split ones)
    assert backend.regions_executed() >= 12


def test_restriding_to_an_expanded_layout_keeps_the_tensor():
    """A partition traced on an expanded mask (stride 0 over heads) may be handed a dense one: no dense
    tensor can take the expanded strides, and the graph's ops take the layout it comes in."""
    t = torch.randn(2, 4, 3)
    assert restrided(t, (3, 0, 1)) is t
    assert not _dense_layout((2, 4, 3), (3, 0, 1)) and _dense_layout((2, 4, 3), (1, 6, 2))
    moved = restrided(t, (1, 6, 2))
    assert moved.stride() == (1, 6, 2) and torch.equal(moved, t)


def test_a_slice_scatter_over_the_whole_dim_clamped():
    """Mistral's sliding window slices keys from -4095 on; the gradient scatters into all of a shorter dim."""
    def f(x, src):
        full = torch.zeros_like(x)
        return torch.ops.aten.slice_scatter.default(full, src * 2, 2, -4095, 9223372036854775807) + x

    x, src = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    assert_close(torch.compile(f, backend="stitchflow")(x, src), f(x, src))
    assert backend.FALLBACKS == []


class _SplitPart(nn.Module):
    """A partition as run_flat sees one (backend.StitchflowModule's protocol): its signature has a split graph, and
    it was traced on a contiguous input."""

    def __init__(self, split, traced_stride):
        super().__init__()
        self.split, self.traced_stride = split, traced_stride

    def split_or_run(self, args):
        return self.split, None

    def traced_layouts(self):
        return [self.traced_stride]


def test_an_inlined_split_takes_its_inputs_in_the_traced_strides():
    """A partition's own eager run puts its inputs in the strides it was traced with (another partition may hand one
    over channels last); its split graph, put in its place by run_flat, does so too: `view` refuses other strides."""
    import torch.fx as fx
    from stitchflow.backend_partition import run_flat

    inner = fx.symbolic_trace(lambda x: x.view(-1) * 2)
    x = torch.randn(2, 3, 4, 5)
    root = nn.Module()
    root.part = _SplitPart(inner, x.stride())
    graph = fx.Graph()
    arg = graph.placeholder("x")
    graph.output(graph.call_module("part", (graph.call_method("relu", (arg,)),)))
    outer = fx.GraphModule(root, graph)
    channels_last = x.to(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match="view"):
        inner(torch.relu(channels_last))
    for _ in range(2):  # inlined on the first run; the second runs the graph it left
        assert_close(run_flat(outer, [channels_last]), x.relu().view(-1) * 2)
