"""Capture's semantics under torch.compile(backend="stitchflow"): what eager does with aliases, in-place
writes, random streams, argument forms and symbolic shapes, the compiled model does too (each case was a
wrong result or a crash found by fuzzing the backend against eager)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stitchflow
from stitchflow import backend
from conftest import assert_close, skip_unless_kernels_run


@pytest.fixture(autouse=True)
def fresh():
    backend.reset()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _zeroed_clone(x):
    y = x.clone()
    y.zero_()  # no lowering: eager, on what the partition before returned
    return y


def test_a_clone_is_a_tensor_of_its_own():
    """clone (and cat of one tensor, repeat(1, 1), ...) lowers as the identity; the output was the input
    itself, so writes to it reached the caller's tensor, or a parameter."""
    x = torch.randn(3, 4)
    kept = x.clone()
    assert torch.equal(torch.compile(_zeroed_clone, backend="stitchflow")(x), torch.zeros(3, 4))
    assert torch.equal(x, kept)
    torch._dynamo.reset()
    out, _ = torch.compile(lambda x: (torch.cat([x]), x.sum()), backend="stitchflow")(x)
    out.add_(1)
    assert torch.equal(x, kept)
    torch._dynamo.reset()
    lin = nn.Linear(4, 4)
    weight = lin.weight.detach().clone()
    with torch.no_grad():
        w, _ = torch.compile(lambda x: (lin.weight.clone(), x + 1), backend="stitchflow")(torch.randn(2, 4))
        w.zero_()
    assert torch.equal(lin.weight, weight)


def _write_through_contiguous(x):
    x.contiguous().add_(1)  # contiguous() returns x itself: eager writes x
    return x * 2


def _write_through_float(x):
    y = x * 2
    y.float().add_(1)  # float() of a float32 tensor is the tensor
    return y


@pytest.mark.parametrize("f", [_write_through_contiguous, _write_through_float])
def test_a_write_through_a_method_that_returns_its_tensor_reaches_it(f):
    """The method's result is its operand, the very tensor: the two names join one value, so the write reaches the
    operand's later readers, and an input's write goes back to the caller's tensor."""
    ours, theirs = torch.ones(2, 3), torch.ones(2, 3)
    assert_close(torch.compile(f, backend="stitchflow")(ours), f(theirs))
    assert_close(ours, theirs)
    assert backend.FALLBACKS == [], backend.fallback_report()


def test_a_write_to_a_value_whose_other_names_are_dead_compiles():
    """`to` of a tensor already on the device returns it: the write reaches the constant too, but nothing reads the
    constant after it (Mamba's cache length), so the write is a new value like any other."""
    def f(x):
        t = torch.ones(3).to(x.device)
        t.add_(x)
        return t * 2

    x = torch.randn(3)
    assert_close(torch.compile(f, backend="stitchflow")(x), f(x))
    assert backend.FALLBACKS == [], backend.fallback_report()


def test_tensor_where_takes_the_tensor_as_the_value():
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    assert_close(torch.compile(lambda a, b: a.where(a > b, b), backend="stitchflow")(a, b), torch.maximum(a, b))
    assert backend.FALLBACKS == [], backend.fallback_report()


@pytest.mark.parametrize("fn", [F.softmax, F.log_softmax])
@pytest.mark.parametrize("x, dtype", [(torch.tensor([[1, 0, -3, -1, -2], [-3, 2, -2, -1, 1]]), torch.float32),
                                      (torch.randn(3, 7) * 30, torch.float64)])
def test_softmax_computes_in_its_dtype_argument(fn, x, dtype):
    f = lambda x: fn(x, 1, dtype=dtype)  # noqa: E731
    out = torch.compile(f, backend="stitchflow")(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, f(x), rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=1e-12)


def test_selu_in_training_keeps_its_scales():
    """AOTAutograd writes F.selu as aten.elu(x, alpha, scale, input_scale); the scales were dropped."""
    x = torch.linspace(-3, 3, 7, requires_grad=True)
    out = torch.compile(lambda x: F.selu(x) * 2, backend="stitchflow", options={"training": "compiled"})(x)
    assert_close(out, F.selu(x.detach()) * 2)
    out.sum().backward()
    y = x.detach().clone().requires_grad_()
    (F.selu(y) * 2).sum().backward()
    assert_close(x.grad, y.grad)


@pytest.mark.parametrize("f", [lambda c, a, b: torch.addmm(c, a, b, beta=0, alpha=2),
                               lambda c, a, b: torch.addmv(c[:, 0], a, b[:, 0], beta=0),
                               lambda c, a, b: torch.addbmm(c, a[None], b[None], beta=0)])
def test_beta_zero_ignores_the_input(f):
    """torch.empty's garbage (NaN, inf) as the input of addmm with beta=0 stays out of the result."""
    c, a, b = torch.full((3, 3), float("nan")), torch.randn(3, 4), torch.randn(4, 3)
    out = torch.compile(f, backend="stitchflow")(c, a, b)
    assert not out.isnan().any()
    assert_close(out, f(c, a, b))


def test_capture_draws_nothing_from_the_random_stream():
    """Capture runs each node on the example, training-mode dropout too: that draw must not advance the caller's
    generator, so the first call (which captures) draws the seed a later call draws after the same manual_seed."""
    f = lambda x: F.dropout(x * 2, 0.5, training=True) + 1  # noqa: E731
    compiled, x = torch.compile(f, backend="stitchflow"), torch.randn(4, 8)
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        outs.append(compiled(x))
    assert torch.equal(outs[0], outs[1])


def test_training_with_a_second_shape_runs():
    """Dynamo recompiles for the second shape with symbolic sizes; the eager fallback then restrided its
    arguments to the traced (symbolic) strides and raised in the user's step."""
    f = torch.compile(lambda a, b: torch.bmm(a, b) * 2, backend="stitchflow")
    for n in (3, 5, 6):
        a, b = torch.randn(2, n, 4, requires_grad=True), torch.randn(2, 4, 5, requires_grad=True)
        f(a, b).sum().backward()
        assert_close(a.grad, (torch.ones(2, n, 5) * 2) @ b.detach().transpose(1, 2))


@pytest.mark.parametrize("f", [lambda x: F.threshold(x, 0.1, 20.0), F.softshrink, F.hardshrink,
                               lambda x: F.hardshrink(x, 0.25)])
def test_activations_keep_a_nan(f):
    x = torch.tensor([float("nan"), -1.0, -0.25, 0.0, 0.3, 2.0, float("inf"), -float("inf")])
    torch.testing.assert_close(torch.compile(f, backend="stitchflow")(x), f(x), equal_nan=True)


@pytest.mark.parametrize("f", [lambda x: x.sum(1, dtype=torch.float64), lambda x: x.mean(1, dtype=torch.float64),
                               lambda x: (1 + x / 1e5).prod(1, dtype=torch.float64),
                               lambda x: torch.logcumsumexp(x.double() / 100, 1)])
def test_reductions_accumulate_in_their_result_type(f):
    """sum(x, dtype=float64) of float32 x casts before it adds (the partial sums were float32), and a
    float64 logcumsumexp stays float64."""
    x = torch.randn(8, 4096, generator=torch.Generator().manual_seed(0)) * 1000
    torch.testing.assert_close(torch.compile(f, backend="stitchflow")(x), f(x), rtol=1e-12, atol=1e-9)


def test_functional_rms_norm_is_lowered():
    """Dynamo records F.rms_norm as torch.rms_norm, which had no lowering: the norm ran eagerly."""
    x, w = torch.randn(4, 16), torch.randn(16)
    f = lambda x: F.rms_norm(x, (16,), w, 1e-6) * 2  # noqa: E731
    assert_close(torch.compile(f, backend="stitchflow")(x), f(x))
    assert backend.FALLBACKS == [], backend.fallback_report()


class _EmptyCacheStart(nn.Module):
    def forward(self, x):
        return torch.cat([torch.tensor([]), x.flatten()]) * 2  # a key/value cache's empty start, as in transformers


def test_an_exported_empty_constant_detached_in_place_is_a_constant():
    """torch.export writes a torch.tensor(...) of the forward as lift_fresh_copy, then detach_: detach_ writes
    no value, and an empty tensor shares memory with nothing (every empty storage has address 0, so it
    'aliased' every other empty tensor, and GPT-2, Llama and OPT could not go through stitchflow.compile)."""
    import stitchflow

    x = torch.randn(3, 4)
    gm = torch.export.export(_EmptyCacheStart(), (x,)).module()
    assert any(n.target is torch.ops.aten.detach_.default for n in gm.graph.nodes)
    prog = stitchflow.compile(gm, (x,))
    y = torch.randn(3, 4)
    assert_close(prog(y), _EmptyCacheStart()(y))


class _ExportedInPlace(nn.Module):
    def forward(self, x, r):
        h = torch.relu(x @ x.T)
        h += r  # torch.export keeps aten.add_ on an intermediate (T5's residual adds)
        h.mul_(0.5)
        return h, x.sum()


def test_exported_aten_in_place_ops_lower_like_their_functional_forms():
    import stitchflow

    x, r = torch.randn(5, 3), torch.randn(5, 5)
    gm = torch.export.export(_ExportedInPlace(), (x, r)).module()
    inplace = {n.target for n in gm.graph.nodes if n.op == "call_function" and n.target._schema.is_mutable}
    assert inplace == {torch.ops.aten.add_.Tensor, torch.ops.aten.mul_.Tensor}
    prog = stitchflow.compile(gm, (x, r))
    x2, r2 = torch.randn(5, 3), torch.randn(5, 5)
    for got, want in zip(prog(x2, r2), _ExportedInPlace()(x2, r2)):
        assert_close(got, want)


def _detached_in_place(x):
    x.detach_()  # eager would detach the caller's tensor; capture must not do it to the example value
    y = x * 2
    y.detach_()
    return y + 1


def test_detach_in_place_is_the_identity_and_leaves_the_caller_tensor_alone():
    import stitchflow

    x = torch.randn(2, 5, requires_grad=True)
    prog = stitchflow.compile(_detached_in_place, (x,))
    assert x.requires_grad  # capture ran detach_ on its own alias of the example value
    with torch.no_grad():
        assert_close(prog(x), x * 2 + 1)
    assert_close(torch.compile(_detached_in_place, backend="stitchflow")(x.detach()), x.detach() * 2 + 1)
    assert "detach_" not in backend.fallback_report()


def _write_through_a_row(z):
    z = z * 2
    row = z[0]
    row += 1  # torch.fx's own Proxy ran this as row = row + 1: z's write was lost without a word
    return z


def _add_into_a_slice(z):
    t = z * 1
    t[:, 1:] += 3  # getitem, iadd, setitem: the item assigned back carries the write
    return t


def _grow_a_size(z):
    n, shape = z.shape[1], z.shape
    n += 1  # Python's += on a traced size, not a write
    shape += (1,)  # nor on a traced shape
    return z.new_zeros(n) + z.reshape(shape).sum()


def _scale_in_place(z):
    y = z.clone()
    y *= 2
    y -= 1
    return y


@pytest.mark.parametrize("f", [_write_through_a_row, _add_into_a_slice, _grow_a_size, _scale_in_place])
def test_augmented_assignments_keep_their_writes(f):
    """Symbolic tracing records x += v as operator.iadd (and x[k] = v as operator.setitem), as Dynamo does; a
    write through a view then takes torch.export's functionalized graph."""
    x = torch.randn(3, 4)
    assert_close(stitchflow.compile(f, (x.clone(),))(x.clone()), f(x.clone()))


def _bump(z):
    z += 1
    return z * 2


def _cache_slot(k_cache, k):
    k_cache[:, 3] = k
    return k_cache.sum(1)


def _cache_rows(k_cache, k):
    k_cache.index_copy_(1, torch.tensor([1, 5]), k)
    return k_cache * 1


def _view_then_write(z):
    v = z[0]
    z.mul_(2)  # v sees it: a view of z
    return v + 1


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("f, shapes", [(_bump, [(3, 4)]), (_cache_slot, [(2, 8, 4), (2, 4)]),
                                       (_cache_rows, [(2, 8, 4), (2, 2, 4)]), (_view_then_write, [(3, 4)])])
def test_inputs_written_in_place_get_the_values_eager_leaves(f, shapes, target):
    """x += 1 and a KV cache's slot written in place change the caller's tensors in eager: the program computes
    the values they end with and copies them back after the call (it used to refuse, and before that to leave
    the caller's tensor unchanged)."""
    skip_unless_kernels_run(target)
    inputs = [torch.randn(*s) for s in shapes]
    prog = stitchflow.compile(f, [x.clone() for x in inputs], target=target)
    ours, eager = [x.clone() for x in inputs], [x.clone() for x in inputs]
    assert_close(prog(*ours), f(*eager))
    for got, want in zip(ours, eager):
        assert_close(got, want)


def test_a_backward_recomputes_from_the_inputs_before_their_write():
    """The backward runs the model again eagerly: from the inputs as they came, not as the forward left them."""
    lin = nn.Linear(4, 4)

    class Accumulate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, cache, x):
            cache += x
            return self.lin(cache).relu()

    model, cache, x = Accumulate(), torch.randn(3, 4), torch.randn(3, 4)
    prog = stitchflow.compile(model, (cache.clone(), x))
    ours, eager = cache.clone(), cache.clone()
    prog(ours, x).sum().backward()
    ours_grad, lin.weight.grad = lin.weight.grad.clone(), None
    model(eager, x).sum().backward()
    assert_close(ours_grad, lin.weight.grad)
    assert_close(ours, eager)


def test_operator_methods_lower_as_the_methods_they_stand_for():
    """torch 2.11's Dynamo records x == y as x.__eq__(y) (and abs(x) as x.__abs__()): those had no lowering,
    so GCN's self-loop mask and LLaVA's image-token mask fell back to eager on the H100."""
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    same = graph.call_method("__eq__", (graph.call_method("__abs__", (x,)), y))
    graph.output(graph.call_method("__mul__", (same, graph.call_method("__truediv__", (x, y)))))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    a, b = torch.randn(4, 5), torch.randn(4, 5).abs() + 0.5
    b[0] = a[0].abs()
    out = backend.stitchflow_backend(gm, [a, b])(a, b)
    assert_close(out[0] if isinstance(out, (tuple, list)) else out, gm(a, b))
    assert backend.FALLBACKS == [], backend.fallback_report()


def _capability(device):  # stands in for torch.cuda.get_device_capability on a machine without CUDA
    return (9, 0)


@pytest.fixture
def capability_is_a_host_query(monkeypatch):
    from stitchflow import backend_partition
    from stitchflow.frontend import capture
    for module in (capture, backend_partition):
        monkeypatch.setattr(module, "HOST_QUERIES", module.HOST_QUERIES | {_capability})


def test_a_question_about_the_device_is_a_constant(capability_is_a_host_query, fresh_dynamo):
    """transformers' MoE asks `torch.cuda.get_device_capability(weight.device)` in its forward, and Dynamo keeps the
    call in the graph: the backend takes the traced answer as a constant and compiles the tensor work around it."""
    asks = torch._dynamo.allow_in_graph(_capability)
    x = torch.randn(3, 4)
    out = torch.compile(lambda x: (x + 1) * asks(x.device)[0], backend="stitchflow")(x)
    assert_close(out, (x + 1) * 9)
    assert not backend.FALLBACKS, backend.fallback_report()
