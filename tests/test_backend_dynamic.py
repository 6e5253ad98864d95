"""Dynamic shapes: a model called at several sizes under torch.compile(backend="stitchflow").

From the second size on (or from the first, with dynamic=True), Dynamo traces for symbolic sizes. Partitions
capture themselves on each call's real arguments, so a new size is a new program; what must hold is that every
size gives eager's answer (and gradients), that Dynamo's own restarts pass through the backend (a float input
made a tensor restarts its analysis: caught, it sent the whole graph to eager), and that the graph's symbolic
size queries (a batch norm's element count) compile with the rest."""

import pytest
import torch
import torch.nn as nn

import stitchflow
from conftest import assert_close, skip_unless_kernels_run, twins
from stitchflow import backend
from stitchflow.ir.errors import StitchflowError

SIZES = (3, 5, 8)


class _Block(nn.Module):
    """Pre-norm attention and a gated feed-forward: the sequence length varies with the batch size."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attention = nn.MultiheadAttention(d, heads, batch_first=True)
        self.up, self.gate, self.down = nn.Linear(d, 32), nn.Linear(d, 32), nn.Linear(32, d)

    def forward(self, x):
        y = self.norm(x)
        x = x + self.attention(y, y, y, need_weights=False)[0]
        return x + self.down(nn.functional.silu(self.gate(x)) * self.up(x)).softmax(-1) * x.mean(1, keepdim=True)


class _CausalAttention(nn.Module):
    """GPT-2's attention: heads split by a view and a transpose, torch's SDPA, merged back by a reshape. In training
    the merge is a view of the attention's output, which is dense only in the layout it was traced with: handed over
    by another partition, the output is put in that layout first (with symbolic strides, by the order of its dims)."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x):
        b, length, d = x.shape
        q, k, v = (t.view(b, length, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(d, -1))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, length, d)) + x


def _mlp():
    return nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.LayerNorm(24), nn.Linear(24, 5))


def _conv_net():
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(6, 4))


CASES = {
    "mlp": (_mlp, lambda n: torch.randn(n, 12)),
    "block": (_Block, lambda n: torch.randn(2, n + 1, 16)),
    "conv": (_conv_net, lambda n: torch.randn(n, 3, n + 4, 5)),
    "attention": (_CausalAttention, lambda n: torch.randn(2, n + 1, 16)),
}


def _run_sizes(make, inputs, dynamic, train: bool, options: dict | None = None, device: str = "cpu") -> None:
    ours, theirs = (m.to(device) for m in twins(make))
    ours.train(train), theirs.train(train)
    compiled = torch.compile(ours, backend="stitchflow", dynamic=dynamic, options=options)
    for n in SIZES:
        x = inputs(n).to(device)
        with torch.set_grad_enabled(train):
            got, want = compiled(x), theirs(x)
            assert_close(got, want)
            if train:
                got.square().sum().backward()
                want.square().sum().backward()
                for p, q in zip(ours.parameters(), theirs.parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
                    p.grad = q.grad = None


def _fallbacks() -> list[str]:
    """The recorded fallbacks, less the convolutions' backward (eager by design: cuDNN's)."""
    return [r for r in backend.FALLBACKS if "convolution_backward" not in r]


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_size_equals_eager_with_no_fallback(case, train, dynamic, fresh_dynamo):
    make, inputs = CASES[case]
    _run_sizes(make, inputs, dynamic, train)
    assert _fallbacks() == [], backend.fallback_report()


@pytest.mark.parametrize("case", ["block", "attention"])
def test_the_gpu_targets_kernels_train_at_every_size(case, fresh_dynamo):
    skip_unless_kernels_run("gpu")
    make, inputs = CASES[case]
    _run_sizes(make, inputs, True, True, {"target": "gpu"}, "cuda" if torch.cuda.is_available() else "cpu")
    assert _fallbacks() == [], backend.fallback_report()


def test_a_float_argument_restarts_dynamos_analysis_through_the_backend(fresh_dynamo):
    """With dynamic=True Dynamo makes a float argument a tensor by restarting its analysis from inside the backend
    (TensorifyScalarRestartAnalysis): the backend lets it pass instead of running the graph eagerly."""
    ours, theirs = twins(_mlp)
    compiled = torch.compile(lambda x, scale: ours(x) * scale, backend="stitchflow", dynamic=True)
    for n, scale in zip(SIZES, (0.5, 2.0, 3.0)):
        x = torch.randn(n, 12)
        got, want = compiled(x, scale), theirs(x) * scale
        assert_close(got, want)
        got.sum().backward()
        want.sum().backward()
        for p, q in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    assert backend.FALLBACKS == [], backend.fallback_report()


def test_a_number_attribute_changed_between_calls_compiles_again(fresh_dynamo):
    """Traced for dynamic shapes, a norm's eps is an input read by item(): the partition keeps a program per
    number, so a changed eps gives eager's answer (Dynamo does not trace again for it)."""
    ours, theirs = twins(_mlp)
    compiled = torch.compile(ours, backend="stitchflow", dynamic=True)
    x = torch.randn(4, 12)
    with torch.no_grad():
        assert_close(compiled(x), theirs(x))
        ours[2].eps = theirs[2].eps = 0.5
        assert_close(compiled(x), theirs(x))
    assert backend.FALLBACKS == [], backend.fallback_report()


def test_a_program_holding_an_inputs_number_refuses_another():
    class Norm(nn.Module):
        def forward(self, x, eps):
            return nn.functional.layer_norm(x, (4,), eps=eps.item()) * 2

    gm = torch.fx.symbolic_trace(Norm())
    x, eps = torch.randn(3, 4), torch.tensor(0.5)
    program = stitchflow.compile(gm, (x, eps))
    assert_close(program(x, eps), Norm()(x, eps))
    with pytest.raises(StitchflowError, match="input eps is read as a number, compiled as 0.5; called with 0.25"):
        program(x, torch.tensor(0.25))
    assert "eps: read as the number 0.5" in program.explain()


def test_a_number_computed_in_the_graph_is_refused_with_the_reason():
    gm = torch.fx.symbolic_trace(lambda x: x * x.sum().item())
    with pytest.raises(StitchflowError, match="item.*a number computed in the graph"):
        stitchflow.compile(gm, (torch.randn(3),))


def test_a_vmap_body_batched_over_a_symbolic_size(fresh_dynamo):
    """Traced for dynamic shapes, the vmap's batch size is computed from a symbolic size between Dynamo's
    lazy_load_decompositions and the body (transformers' Mamba scan takes every other step): the rewrite on whole
    tensors takes the marker with the body."""
    def fn(x, w):
        return torch.vmap(lambda a, b: (a * w).tanh() + b.sum(-1, keepdim=True))(x[1::2], x[1::2].exp())

    compiled = torch.compile(fn, backend="stitchflow", dynamic=True)
    w = torch.randn(6)
    for n in (4, 6, 10):
        x = torch.randn(n, 6)
        assert_close(compiled(x, w), fn(x, w))
    assert backend.FALLBACKS == [], backend.fallback_report()


def test_an_empty_slice_of_a_symbolic_shape_folds_at_capture(fresh_dynamo):
    """A partial rotary embedding that rotates every channel leaves an empty pass-through, x[..., d:], then joins it
    back (Phi-3). With symbolic sizes the backend cannot fold it to a constant of fixed shape up front; capture,
    on the call's real shapes, takes it as the constant it is (no elements, no data) and torch.cat skips it."""
    def fn(x):
        rotated, passed = x[..., :8], x[..., 8:]
        return torch.cat((rotated.sin() * 2, passed), -1)

    compiled = torch.compile(fn, backend="stitchflow", dynamic=True)
    for n in SIZES:
        x = torch.randn(2, n, 8)
        assert_close(compiled(x), fn(x))
    assert backend.FALLBACKS == [], backend.fallback_report()


def test_past_max_programs_new_shapes_run_eagerly_with_the_reason(fresh_dynamo):
    ours, theirs = twins(_mlp)
    compiled = torch.compile(ours, backend="stitchflow", dynamic=True, options={"max_programs": 2})
    with torch.no_grad():
        for n in (3, 4, 5, 3):
            x = torch.randn(n, 12)
            assert_close(compiled(x), theirs(x))
    assert len(backend.FALLBACKS) == 1 and "2 programs compiled" in backend.FALLBACKS[0], backend.fallback_report()
    assert sum(p is not None for m in backend.COMPILED for p in m.programs.values()) == 2
