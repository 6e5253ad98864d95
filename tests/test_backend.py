"""torch.compile(model, backend="stitchflow"): equals eager, runs through our interpreter,
falls back to eager (with a reason) for what it cannot capture."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import stitchflow.backend as backend
from stitchflow.backend_calls import is_dense
from stitchflow.backend_layouts import restrided
from conftest import assert_close, dynamo_graph
from stitchflow.apps import APPS

DENSE_APPS = ["sae", "gpt3-bigbird", "bert", "llama", "resnet", "unet"]


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_backend_is_registered_by_name():
    from importlib.metadata import entry_points

    from torch._dynamo.backends.registry import list_backends

    assert "stitchflow" in list_backends(exclude_tags=())
    installed = {ep.name: ep.value for ep in entry_points(group="torch_dynamo_backends")}
    if installed:  # a pip-installed copy also registers through the entry point
        assert installed.get("stitchflow") == "stitchflow.backend:stitchflow_backend"


def test_backend_by_name_in_a_fresh_process():
    """A user's first touch: backend="stitchflow" without importing stitchflow, which an installed
    copy's entry point serves (the package registering the name itself as well made torch's lookup
    fail with "duplicate name"), and then the same after importing it."""
    code = ("import torch\n"
            "f = torch.compile(lambda x: x.sin() + 1, backend='stitchflow')\n"
            "x = torch.randn(5)\n"
            "assert torch.allclose(f(x), x.sin() + 1)\n"
            "import stitchflow\n"
            "g = torch.compile(lambda x: x.cos() * 2, backend='stitchflow')\n"
            "assert torch.allclose(g(x), x.cos() * 2)\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


@pytest.mark.parametrize("app", DENSE_APPS)
def test_dense_apps_equal_eager(app):
    model, inputs = APPS[app].build(size="small")
    compiled = torch.compile(model, backend="stitchflow")
    with torch.no_grad():
        assert_close(compiled(*inputs), model(*inputs))
        assert_close(compiled(*inputs), model(*inputs))  # the cached program
    assert backend.regions_executed() >= 2  # the outputs came from stitchflow programs


class _InvertedResidual(nn.Module):  # MobileNetV2's: expand, depthwise, project
    def __init__(self, c: int, e: int = 4):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c, c * e, 1, bias=False), nn.BatchNorm2d(c * e), nn.ReLU6(),
            nn.Conv2d(c * e, c * e, 3, 1, 1, groups=c * e, bias=False), nn.BatchNorm2d(c * e), nn.ReLU6(),
            nn.Conv2d(c * e, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.body(x)


class _UNet(nn.Module):  # group and instance norm, pooling, bilinear upsampling, a skip concatenation
    def __init__(self):
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU())
        self.down2 = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.InstanceNorm2d(16), nn.GELU())
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.out = nn.Conv2d(24, 2, 1)

    def forward(self, x):
        a = self.down1(x)
        return self.out(torch.cat([a, self.up(self.down2(a))], 1)).softmax(1)


class _SqueezeExcite(nn.Module):  # circular padding, a global pool gating the channels, an overlapping pool
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, padding_mode="circular")
        self.fc1, self.fc2 = nn.Linear(c, c // 2), nn.Linear(c // 2, c)

    def forward(self, x):
        y = self.conv(x)
        w = torch.sigmoid(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(y, 1).flatten(1)))))
        return F.hardswish(y * w[:, :, None, None]) + F.avg_pool2d(x, 3, 1, 1)


class _VGGHead(nn.Module):  # a dilated convolution and an adaptive pool to 3x3
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, 2),
                                      nn.Conv2d(8, 8, 3, dilation=2, padding=2), nn.ReLU())
        self.pool, self.fc = nn.AdaptiveAvgPool2d((3, 3)), nn.Linear(72, 5)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


class _Conv1dTagger(nn.Module):  # a strided 1-d convolution with reflect padding, then layer norm
    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.Conv1d(4, 6, 5, stride=2, padding=2, padding_mode="reflect"), nn.LayerNorm(6)

    def forward(self, x):
        return self.norm(F.leaky_relu(self.conv(x)).transpose(1, 2))


def _decoder():  # a GAN generator's / U-Net decoder's upsampling by transposed convolutions
    return nn.Sequential(nn.ConvTranspose2d(6, 4, 4, 2, 1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.ConvTranspose2d(4, 3, 3, 2, 1, output_padding=1), nn.Tanh())


CNNS = {"mobilenet": (lambda: _InvertedResidual(4), (2, 4, 9, 9)), "unet": (_UNet, (2, 3, 16, 12)),
        "decoder": (_decoder, (2, 6, 5, 4)),
        "squeeze_excite": (lambda: _SqueezeExcite(8), (2, 8, 7, 7)), "vgg": (_VGGHead, (2, 3, 14, 14)),
        "conv1d": (_Conv1dTagger, (2, 4, 17))}


@pytest.mark.parametrize("name", sorted(CNNS))
def test_convolutional_models_run_wholly_through_stitchflow(name):
    make, shape = CNNS[name]
    torch.manual_seed(0)
    model, x = make().eval(), torch.randn(shape)
    compiled = torch.compile(model, backend="stitchflow")
    with torch.no_grad():
        assert_close(compiled(x), model(x))
    assert backend.FALLBACKS == []


def _pyg_layers(conv: str):
    """Two torch_geometric layers (12 -> 16 -> 5 features) of one kind: sum, mean, max and min aggregation, and
    attention (GAT's softmax over each node's incoming edges: a scatter max, a gather and a scatter sum)."""
    from torch_geometric import nn as pyg

    return {
        "gcn": lambda: (pyg.GCNConv(12, 16), pyg.GCNConv(16, 5)),
        "sage": lambda: (pyg.SAGEConv(12, 16), pyg.SAGEConv(16, 5)),
        "sage_max": lambda: (pyg.SAGEConv(12, 16, aggr="max"), pyg.SAGEConv(16, 5, aggr="max")),
        "graphconv_min": lambda: (pyg.GraphConv(12, 16, aggr="min"), pyg.GraphConv(16, 5, aggr="mean")),
        "gat": lambda: (pyg.GATConv(12, 4, heads=4), pyg.GATConv(16, 5)),
        "gatv2": lambda: (pyg.GATv2Conv(12, 4, heads=4), pyg.GATv2Conv(16, 5)),
        "gin": lambda: (pyg.GINConv(nn.Sequential(nn.Linear(12, 16), nn.ReLU())), pyg.GINConv(nn.Linear(16, 5))),
    }[conv]()


class GraphNet(nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.conv1, self.conv2 = _pyg_layers(conv)

    def forward(self, x, edge_index):
        return F.log_softmax(self.conv2(F.relu(self.conv1(x, edge_index)), edge_index), dim=-1)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("conv", ["gcn", "sage", "sage_max", "graphconv_min", "gat", "gatv2", "gin"])
def test_torch_geometric_models(conv):
    """Inference and a training step's gradients equal eager's, with nothing left to eager."""
    torch.manual_seed(0)
    model = GraphNet(conv).eval()
    x, edge_index = torch.randn(40, 12), torch.randint(0, 40, (2, 150))
    compiled = torch.compile(model, backend="stitchflow")
    with torch.no_grad():
        assert_close(compiled(x, edge_index), model(x, edge_index))
    assert backend.regions_executed() >= 1
    kinds = [str(n) for m in backend.COMPILED for p in m.programs.values() if p for n in p.graph.nodes]
    assert any(op in k for k in kinds for op in (" += ", " max= ", " min= "))  # aggregation captured as a scatter
    loss, want = compiled(x, edge_index).square().sum(), model(x, edge_index).square().sum()
    got, expected = (torch.autograd.grad(t, list(model.parameters())) for t in (loss, want))
    scale = max(g.abs().max() for g in expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g / scale, e / scale, rtol=0, atol=1e-5)
    assert not backend.FALLBACKS, backend.fallback_report()


def test_unsupported_ops_fall_back_with_a_reason():
    def f(x):
        y = torch.relu(x) * 2
        z = torch.i0(y)  # no lowering: runs eagerly
        return torch.softmax(z, -1) + 1

    x = torch.randn(5, 7)
    compiled = torch.compile(f, backend="stitchflow")
    assert_close(compiled(x), f(x))
    assert "i0" in backend.fallback_report()
    assert backend.regions_executed() >= 2  # the parts around it still ran through stitchflow


def test_an_eager_op_splits_only_what_depends_on_it():
    """The relu, the scaling and the softmax do not depend on the Bessel function: one partition after it
    holds them all (program order would have split them into two around it)."""
    def f(x):
        y = torch.relu(x) * 2
        s = torch.i0(x)
        return torch.softmax(y, -1) + s

    x = torch.randn(5, 7)
    assert_close(torch.compile(f, backend="stitchflow")(x), f(x))
    (module,) = backend.COMPILED
    assert module.regions_executed >= 1


def test_an_in_place_write_keeps_program_order():
    """x.fill_diagonal_ runs eagerly and writes x, which later nodes read through the same FX node
    as earlier ones: partitions must not move the exp across it."""
    def f(x):
        y = x.exp() * 2
        x.fill_diagonal_(0)
        return y.softmax(-1) + x

    x = torch.randn(5, 7)
    assert_close(torch.compile(f, backend="stitchflow")(x.clone()), f(x.clone()))
    assert len(backend.COMPILED) == 2


def test_a_partition_of_views_only_and_ops_between_eager_ones():
    """Partitions between unsupported ops may hold nothing but a slice (no node to plan) or a
    single op; the planner once failed on the empty one (zero-size array) and broke the model."""
    def f(x):
        a = torch.fft.rfft(x, dim=1).abs()
        b = torch.i0(x)[:, :3]
        c = torch.special.i1(x)[:, :3]
        return torch.cat([a[:, :3], b, c, torch.where(x > 0, x, x.exp() - 1)[:, :3]], 1).std(0)

    x = torch.randn(5, 8)
    assert_close(torch.compile(f, backend="stitchflow")(x), f(x))


def test_an_internal_error_while_compiling_runs_the_partition_eagerly(monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("a planner bug")

    monkeypatch.setattr(backend, "regions_for", broken)
    f = lambda x: torch.softmax(x * 2, -1)  # noqa: E731
    x = torch.randn(4, 6)
    assert_close(torch.compile(f, backend="stitchflow")(x), f(x))
    assert "internal error, ValueError: a planner bug" in backend.fallback_report()


def test_a_program_failing_on_its_first_call_runs_eagerly_from_then_on(monkeypatch):
    calls = []

    def broken(self, *args):
        calls.append(1)
        raise RuntimeError("a kernel that does not build")

    monkeypatch.setattr(backend.Program, "__call__", broken)
    f = lambda x: torch.relu(x) + 1  # noqa: E731
    compiled = torch.compile(f, backend="stitchflow")
    x = torch.randn(3, 5)
    assert_close(compiled(x), f(x))
    assert_close(compiled(x), f(x))
    assert calls == [1]  # tried once, then eager
    assert "failed on the first call, RuntimeError: a kernel that does not build" in backend.fallback_report()


def test_a_partition_run_eagerly_takes_its_inputs_in_the_strides_it_was_traced_with():
    """Another partition may hand a tensor over channels last; where this one then runs eagerly (its program
    failed), an eager op may refuse that layout (a view here; CUDA's native_group_norm) or read it wrongly."""
    import torch.fx as fx

    gm = fx.symbolic_trace(lambda x: x.view(2, -1) * 2)
    x = torch.randn(2, 3, 4, 5)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["val"] = torch.empty_like(x)
    module = backend.StitchflowModule(gm, "reference", "auto", "partition")
    last = x.contiguous(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError):
        gm(last)  # the view of a channels-last tensor
    assert_close(module._eager((last,)), x.view(2, -1) * 2)


def test_a_partition_captures_its_example_inputs_in_the_strides_it_was_traced_with(monkeypatch):
    """A convolution weight the forward stored channels last made eager's convolution return channels last
    in the capture's example run, and CUDA's native_group_norm refused it: the whole UNet forward ran
    eagerly. The capture takes its examples in the traced strides; the program still gets the tensor as is."""
    import torch.fx as fx

    gm = fx.symbolic_trace(lambda x, w: F.group_norm(F.conv2d(x, w, padding=1), 2))
    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    for node, val in zip((n for n in gm.graph.nodes if n.op == "placeholder"), (x, w)):
        node.meta["val"] = torch.empty_like(val)
    seen, original = [], backend.capture
    monkeypatch.setattr(backend, "capture", lambda g, args, **kw: seen.append([a.stride() for a in args])
                        or original(g, args, **kw))
    module = backend.StitchflowModule(gm, "reference", "auto", "partition")
    last = w.contiguous(memory_format=torch.channels_last)
    assert_close(module(x, last), F.group_norm(F.conv2d(x, w, padding=1), 2))
    assert seen == [[x.stride(), w.stride()]]


def test_training_through_the_backend_gets_eagers_gradients():
    """Where autograd records, a partition's forward runs through stitchflow and its backward
    differentiates the eager graph: the same gradients, and the same parameters after SGD steps."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4), nn.Softmax(-1))
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="stitchflow")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    weights = torch.arange(4.0)
    for _ in range(3):
        x = torch.randn(5, 8)
        xs = (x.clone().requires_grad_(), x.clone().requires_grad_())
        out, ref = compiled(xs[0]), reference(xs[1])
        assert_close(out, ref)
        (out * weights).sum().backward()
        (ref * weights).sum().backward()
        assert_close(xs[0].grad, xs[1].grad)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert_close(p.grad, q.grad)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close(p, q)
    assert backend.regions_executed() >= 3  # every forward ran through stitchflow
    with torch.no_grad():
        assert not compiled(torch.randn(5, 8)).requires_grad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_training_on_cuda_through_the_gpu_target():
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 64)).cuda()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="stitchflow")
    for _ in range(4):  # the program's second and third calls time eager launches against a CUDA-graph replay
        x = torch.randn(512, 64, device="cuda")
        out, ref = compiled(x), reference(x)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        out.square().sum().backward()
        ref.square().sum().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-3)
            p.grad, q.grad = None, None


@pytest.mark.parametrize("training", ["compiled", "recompute"])
def test_batch_norm_compiles_in_eval_mode_and_updates_running_statistics_once_in_training(training):
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(6), nn.ReLU())
    with torch.no_grad():
        model[0].weight.normal_(), model[0].bias.normal_()
    x = torch.randn(4, 6, 5, 7)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="stitchflow", options={"training": training})
    for _ in range(2):
        assert_close(compiled(x), reference(x))
    assert_close(model[0].running_mean, reference[0].running_mean)
    assert_close(model[0].running_var, reference[0].running_var)
    assert int(model[0].num_batches_tracked) == 2
    if training == "recompute":  # the op updating the running statistics runs eagerly, once per call
        assert "running statistics in place" in backend.fallback_report()
    else:  # AOTAutograd made the update a graph output, which AOTAutograd's wrapper copies back
        assert backend.fallback_report().endswith("everything captured ran through stitchflow")
    torch._dynamo.reset()
    backend.reset()
    model.eval(), reference.eval()
    compiled = torch.compile(model, backend="stitchflow")
    assert_close(compiled(x), reference(x))
    assert backend.regions_executed() >= 1 and "batch_norm" not in backend.fallback_report()


def test_reference_target_option_and_fusion_option():
    model, inputs = APPS["bert"].build(size="small")
    compiled = torch.compile(model, backend="stitchflow", options={"target": "reference", "fusion": "unfused"})
    with torch.no_grad():
        assert_close(compiled(*inputs), model(*inputs))
    progs = [p for m in backend.COMPILED for p in m.programs.values() if p]
    assert progs and all(p.fusion == "unfused" and p.target_name == "reference" for p in progs)


def test_parameters_are_bound_in_place_and_checked_each_call():
    """Weights enter the program as parameters read in place (a CUDA-graph replay then copies
    only the activations); in-place updates are seen, and a replaced weight recompiles."""
    model, inputs = APPS["llama"].build(size="small")
    compiled = torch.compile(model, backend="stitchflow", dynamic=False)
    with torch.no_grad():
        assert_close(compiled(*inputs), model(*inputs))
        (module,) = backend.COMPILED
        (prog,) = [p for p in module.programs.values() if p]
        assert len(prog.graph.inputs) == 1 and len(prog.graph.params) >= 9  # x alone stays an input
        model.norm2.weight.mul_(1.5)
        assert_close(compiled(*inputs), model(*inputs))
        model.norm2.weight = nn.Parameter(model.norm2.weight * 2)
        assert_close(compiled(*inputs), model(*inputs))
        x2 = torch.randn_like(inputs[0])
        assert_close(compiled(x2), model(x2))
        # the same Parameter objects with new storage (`p.data = ...`: vector_to_parameters, weight loading)
        nn.utils.vector_to_parameters(nn.utils.parameters_to_vector(model.parameters()) * 1.25, model.parameters())
        assert_close(compiled(x2), model(x2))


def test_items_of_an_eager_ops_results_stay_with_it():
    """An op run eagerly that returns a tuple (torch.linalg.qr) keeps its getitems in its eager part,
    so the next partition takes tensors, not the tuple; the report names the op once."""
    def f(x):
        q, r = torch.linalg.qr(x * 2)
        return (q.relu() + r.sum(0)).softmax(-1)

    x = torch.randn(6, 6)
    compiled = torch.compile(f, backend="stitchflow")
    assert_close(compiled(x), f(x))
    report = backend.fallback_report()
    assert "linalg_qr" in report and "getitem" not in report, report
    assert backend.regions_executed() >= 2


def test_outputs_read_eagerly_leave_in_eagers_strides_only_where_they_matter():
    x = torch.randn(2, 3, 4)
    permuted = x.permute(2, 0, 1)
    assert is_dense(permuted) and not is_dense(x[:, :2]) and not is_dense(x[:1].expand(5, 3, 4))
    ours = permuted.contiguous()
    fixed = restrided(ours, permuted.stride())
    assert fixed.stride() == permuted.stride() and torch.equal(fixed, permuted)
    kept = torch.randn(4, 1, 3)
    assert restrided(kept, (3, 7, 1)) is kept  # a size-1 dim's stride does not matter
    assert restrided(kept, None) is kept


def _zero_a_row(x):
    y = x * 2
    y[0].zero_()
    return y


def _fill_an_input_row(x):
    x[0].fill_(5.0)
    return x + 1


def _view_read_after_a_write(x):
    y = x * 2
    v = y[0]
    y.zero_()
    return v + 1


def _zero_a_transpose(x):
    y = x * 2
    z = y.t()
    z.zero_()
    return y.sum() + z


@pytest.mark.parametrize("f", [_zero_a_row, _fill_an_input_row, _view_read_after_a_write, _zero_a_transpose])
def test_an_eager_write_through_a_view_runs_the_graph_eagerly(f):
    """A partition's outputs are tensors of their own, so an eager in-place op (zero_, fill_: no lowering)
    on a view of one wrote only a copy; such a graph runs eagerly as a whole, with the reason."""
    x = torch.ones(2, 3)
    want = f(x.clone())
    assert_close(torch.compile(f, backend="stitchflow")(x.clone()), want)
    assert "aliases (a view)" in backend.fallback_report()


def test_an_eager_write_to_a_tensor_of_its_own_keeps_the_rest_compiled():
    def f(x):
        y = x.clone()
        y.mul_(2).zero_()
        return (y + 1).softmax(-1)

    x = torch.randn(2, 3)
    assert_close(torch.compile(f, backend="stitchflow")(x), f(x))
    assert "aliases" not in backend.fallback_report() and backend.regions_executed() >= 1


def _vmapped_then_written(x, out):
    z = torch.vmap(lambda row: (row * 2 + 1) @ row)(x)  # (a matmul: the body is not rewritten, backend_vmap)
    out.zero_()  # an eager write in place, in a graph whose vmap nodes hold no tensors
    return (z + out).softmax(-1)


def test_a_vmap_body_runs_eagerly_and_the_rest_compiles(monkeypatch):
    """Dynamo inlines torch.vmap's body; its values are functorch's batched tensors, which have no storage:
    the alias check read their storage and the whole graph ran eagerly (Mamba's selective scan in transformers),
    and a partition captured on them failed on its first call. Where AOTAutograd cannot trace the body away (made
    to fail here), the body stays eager with the reason and the ops around it compile."""
    import stitchflow.training as training

    monkeypatch.setattr(training, "_through_aot", lambda *args, **kwargs: None)
    x, out = torch.randn(4, 5), torch.randn(4)
    want = _vmapped_then_written(x, out.clone())
    assert_close(torch.compile(_vmapped_then_written, backend="stitchflow")(x, out), want)
    report = backend.fallback_report()
    assert "batched by torch.vmap" in report and "whole graph" not in report and "failed" not in report
    assert "not rewritten on whole tensors" in report
    assert backend.regions_executed() >= 1


def test_a_vmap_body_the_rewrite_does_not_take_compiles_through_aotautograd():
    x, out = torch.randn(4, 5), torch.randn(4)
    want = _vmapped_then_written(x, out.clone())
    assert_close(torch.compile(_vmapped_then_written, backend="stitchflow")(x, out), want)
    assert backend.FALLBACKS == [], backend.fallback_report()


def test_a_partition_without_cuda_inputs_that_makes_cuda_tensors_runs_on_the_gpu_target():
    """BART's mask partition takes only a CPU constant (a dtype's minimum) and makes its tensors on the device:
    its traced values say CUDA, and that chooses the gpu target and the device (traced with fake CUDA tensors,
    which need no GPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = fx.Graph()
    low = graph.placeholder("low")
    mask = graph.call_function(torch.full, ((4, 4), low), {"device": "cuda"})
    graph.output(mask)
    with FakeTensorMode(allow_non_fake_inputs=True):
        low.meta["val"], mask.meta["val"] = torch.tensor(-1.0), torch.full((4, 4), -1.0, device="cuda")
    assert backend.traced_cuda_device(fx.GraphModule(torch.nn.Module(), graph)) == torch.device("cuda", 0)
    mask.meta["val"] = torch.full((4, 4), -1.0)
    assert backend.traced_cuda_device(fx.GraphModule(torch.nn.Module(), graph)) is None


def _bidirectional_keep():
    """BART's encoder mask as transformers 5 makes it: aranges alone, no tensor read."""
    positions = torch.arange(32) + 0
    return (positions[None, None, :, None] >= 0).expand(2, -1, 32, 32)


def test_a_gpu_program_that_reads_no_tensor_makes_its_outputs_on_the_programs_device():
    """A kernel that reads nothing runs its nodes through torch (an arange has no input to say where): on the
    program's device, which the backend sets from the traced values. On the CPU they landed, and the next graph
    met BART's mask there. (The meta device stands in for CUDA.)"""
    from stitchflow.frontend.capture import capture
    from stitchflow.planner.regions import regions_for
    from stitchflow.program import Program

    captured = capture(dynamo_graph(_bidirectional_keep)[0], [])
    regions = regions_for(captured.graph, "auto", target="gpu")
    out = Program(captured, regions, "gpu", "auto", {"device": torch.device("meta")})()
    out = out[0] if isinstance(out, (tuple, list)) else out
    assert out.device.type == "meta" and out.shape == (2, 1, 32, 32) and out.dtype == torch.bool


def test_a_program_output_on_another_device_than_traced_runs_eagerly_with_the_reason():
    """The first call checks each output's device against its traced value's: a mismatch would fail in the
    next graph, far from its cause, so the partition runs eagerly instead and says why."""
    gm = dynamo_graph(_bidirectional_keep)[0]
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    output.meta["example_value"] = torch.empty(2, 1, 32, 32, dtype=torch.bool, device="meta")
    backend.FALLBACKS.clear()
    module = backend.StitchflowModule(gm, "reference", "auto", "mask")
    want = _bidirectional_keep()
    assert_close(module()[0], want)
    assert "mask: its program failed on the first call" in backend.fallback_report()
    assert "output 0 came out on cpu, traced on meta" in backend.fallback_report()
    assert_close(module()[0], want)


def test_indexing_by_a_tensor_made_in_the_graph_compiles():
    """x.flatten()[torch.tensor([...])]: torch.fx's partitioner moved the index's getitem between the
    indexed tensor's partition and the eager torch.tensor's forever (the compile never returned)."""
    f = lambda x: (x * 2).flatten()[torch.tensor([0, 44, -1])].sum()  # noqa: E731
    x = torch.randn(5, 9)
    assert_close(torch.compile(f, backend="stitchflow")(x), f(x))


def _mask_and_positions(x):
    """A sliding-window mask made on x's device beside positions eager leaves on the CPU (Starcoder2's masks)."""
    positions = torch.arange(x.shape[-1]) * 2
    mask = (torch.arange(x.shape[-1], device=x.device)[:, None] >= torch.arange(x.shape[-1], device=x.device)) * x
    return mask.softmax(-1), positions + 1


def test_outputs_eager_made_on_the_cpu_are_found_by_their_traced_device():
    """A partition that makes CUDA tensors compiles for the GPU whole; the outputs traced on the CPU leave there."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gm = dynamo_graph(_mask_and_positions, torch.randn(4, 4))[0]
    assert backend.traced_on_host(gm) == frozenset()  # nothing on CUDA: nothing moves
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    with FakeTensorMode():
        output[0].meta["example_value"] = torch.empty(4, 4, device="cuda")
    assert backend.traced_on_host(gm) == frozenset({1})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_outputs_eager_made_on_the_cpu_come_out_there():
    x = torch.randn(6, 6, device="cuda")
    backend.FALLBACKS.clear()
    got, want = torch.compile(_mask_and_positions, backend="stitchflow")(x), _mask_and_positions(x)
    assert [t.device.type for t in got] == ["cuda", "cpu"]
    assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])
    assert not backend.FALLBACKS, backend.fallback_report()
