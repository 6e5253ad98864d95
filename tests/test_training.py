"""Training through torch.compile(backend="stitchflow"): AOTAutograd's forward and backward graphs
both compiled (stitchflow/training.py). Every case trains a model and a deep copy side by side and
compares outputs, input and parameter gradients, and the parameters after optimizer steps."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import stitchflow.backend as backend
import stitchflow.training as training
from conftest import TOL, assert_close, skip_unless_kernels_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class _Block(nn.Module):
    """A pre-norm transformer block: layer norm, attention, residual, layer norm, GELU MLP, residual."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class _Classifier(nn.Module):
    """RMS-normed MLP with SiLU and a cross-entropy loss computed in the graph."""

    def __init__(self, d: int = 24, classes: int = 7):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.hidden, self.out = nn.Linear(d, 40), nn.Linear(40, classes)

    def forward(self, x, labels):
        logits = self.out(F.silu(self.hidden(self.norm(x))))
        return F.cross_entropy(logits, labels, label_smoothing=0.1)


def _conv_net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=8),
                         nn.BatchNorm2d(8), nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def _close(ours, eager, truth=None, **tol):
    """Equal to eager within the dtype's tolerance; or, given `truth` (the float64 model's value), no
    further from float64 than twice eager's RMS error (Inductor's rule: in half precision our kernels
    keep float32 intermediates where eager rounds after every op; in float32, summation orders differ
    and SGD with momentum carries the difference on)."""
    if truth is None:
        torch.testing.assert_close(ours, eager, **(TOL.get(eager.dtype, dict(rtol=0, atol=0)) | tol))
        return
    rms = lambda t: (t.double() - truth).pow(2).mean().sqrt().item()  # noqa: E731
    assert rms(ours) <= 2 * rms(eager) + TOL[eager.dtype]["atol"] / 10, (rms(ours), rms(eager))


def _train_side_by_side(model, make_inputs, steps=3, loss=lambda out: out.square().mean(), options=None,
                        exact=False, **tol):
    """Train `model` compiled and an eager deep copy with SGD on the same inputs; compare as they go
    (`exact`: also a float64 copy, against which both are judged)."""
    reference = copy.deepcopy(model)
    exact = copy.deepcopy(model).double() if exact else None
    compiled = torch.compile(model, backend="stitchflow", options=options or {})
    models = [m for m in (model, reference, exact) if m is not None]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    for _ in range(steps):
        inputs = make_inputs()
        runs = [[x.clone().requires_grad_() if x.is_floating_point() else x for x in inputs] for _ in models]
        if exact:
            runs[2] = [x.detach().double().requires_grad_() if x.is_floating_point() else x for x in runs[2]]
        outs = [f(*xs) for f, xs in zip([compiled, *models[1:]], runs)]
        _close(outs[0], outs[1], outs[2].detach() if exact else None, **tol)
        for out in outs:
            loss(out).backward()
        for k, x in enumerate(runs[0]):
            if x.is_floating_point():
                _close(x.grad, runs[1][k].grad, runs[2][k].grad if exact else None, **tol)
        for params in zip(*(m.parameters() for m in models)):
            _close(params[0].grad, params[1].grad, params[2].grad if exact else None, **tol)
        for opt in optimizers:
            opt.step(), opt.zero_grad()
    if not exact:
        for p, q in zip(model.parameters(), reference.parameters()):
            _close(p, q, **tol)
        for a, b in zip(model.buffers(), reference.buffers()):
            _close(a, b, **tol)
    return compiled


def _compiled_graphs() -> set[str]:
    return {m.name.split(".")[0] for m in backend.COMPILED if m.regions_executed}


def test_mlp_trains_like_eager_with_both_graphs_through_stitchflow():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4), nn.Softmax(-1))
    _train_side_by_side(model, lambda: (torch.randn(5, 8),), loss=lambda out: (out * torch.arange(4.0)).sum())
    assert _compiled_graphs() == {"forward", "backward"}
    assert backend.fallback_report().endswith("everything captured ran through stitchflow")


def test_transformer_block_trains_like_eager_with_attention_eager():
    """Attention's ATen kernels run as torch's (by design: not recorded as fallbacks); their inputs leave
    our partitions in eager's strides, since the graph after them was traced on those strides."""
    torch.manual_seed(0)
    _train_side_by_side(_Block(), lambda: (torch.randn(2, 9, 32),), exact=True)
    assert _compiled_graphs() == {"forward", "backward"}
    assert backend.fallback_report().endswith("everything captured ran through stitchflow")


class _ScaledMaskedScores(nn.Module):
    """Attention scores scaled by a tensor made from a Python number and masked with the dtype's minimum, as
    DeBERTa and BART write them: AOTAutograd lifts such numbers as 0-dim constants on the CPU."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        scale = torch.sqrt(torch.tensor(x.size(-1), dtype=torch.float) * 2)
        scores = self.q(x) @ (self.k(x).transpose(-1, -2) / scale.to(x.dtype))
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=x.device).tril()
        return scores.masked_fill(~keep, torch.finfo(scores.dtype).min).softmax(-1)


def test_constants_made_from_python_numbers_train_through_stitchflow():
    """On CUDA such constants were kernel arguments on the CPU: DeBERTa's programs failed on their first call
    (and ran eagerly), and a mask computed from one came out on the CPU, where BART's next graph failed to trace.
    A gpu program moves such inputs to the device (Program._scalars_to_device)."""
    torch.manual_seed(0)
    _train_side_by_side(_ScaledMaskedScores(), lambda: (torch.randn(2, 6, 16),), loss=lambda out: (out * out).sum())
    assert _compiled_graphs() == {"forward", "backward"}
    assert "failed" not in backend.fallback_report()


def test_loss_in_the_graph_with_integer_labels():
    torch.manual_seed(0)
    _train_side_by_side(_Classifier(), lambda: (torch.randn(13, 24), torch.randint(0, 7, (13,))), loss=lambda out: out)
    assert _compiled_graphs() == {"forward", "backward"}


def test_batch_norm_network_trains_and_tracks_running_statistics():
    """Batch norm in training mode compiles whole (its running-statistics update is a graph output);
    the convolutions' backward runs eagerly, with its reason."""
    torch.manual_seed(0)
    _train_side_by_side(_conv_net(), lambda: (torch.randn(4, 3, 9, 9),), exact=True)
    assert "convolution_backward" in backend.fallback_report()
    assert "backward" in _compiled_graphs()


@pytest.mark.parametrize("target", ["reference", "gpu"])
def test_group_norm_forward_compiles_with_its_statistics(target):
    """AOTAutograd's forward holds native_group_norm (its mean and rstd are saved for the backward):
    lowered, so only the eager convolution backwards are left in the report (UNet's training step)."""
    skip_unless_kernels_run(target)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(), nn.Conv2d(8, 4, 1)).to(
        DEVICE if target == "gpu" else "cpu")
    device = next(model.parameters()).device
    _train_side_by_side(model, lambda: (torch.randn(2, 3, 7, 6, device=device),), steps=2, options={"target": target})
    report = backend.fallback_report()
    assert "native_group_norm" not in report
    assert all("convolution_backward" in line for line in report.splitlines()[1:]), report


def test_batch_norm_in_eval_mode_while_fine_tuning():
    torch.manual_seed(0)
    model = _conv_net()
    model(torch.randn(6, 3, 9, 9))  # running statistics away from their initial values
    model.eval()
    _train_side_by_side(model, lambda: (torch.randn(4, 3, 9, 9),), exact=True)


def test_bfloat16_training():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.SiLU(), nn.Linear(32, 16)).to(torch.bfloat16)
    _train_side_by_side(model, lambda: (torch.randn(10, 16, dtype=torch.bfloat16),), steps=2, exact=True)
    assert _compiled_graphs() == {"forward", "backward"}


def test_dropout_gradient_follows_the_mask_the_forward_drew():
    """Random numbers differ from eager's, so compare with the mask this forward drew: the input's
    gradient is 1/(1-p) where an element was kept and 0 where it was dropped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 12), nn.Dropout(0.25))
    compiled = torch.compile(model, backend="stitchflow")
    hidden = torch.randn(64, 12)
    x = hidden.clone().requires_grad_()
    out = compiled(x)
    kept = out != 0
    assert 0.5 < kept.float().mean() < 0.95
    out.sum().backward()
    w = model[0].weight
    expected = (kept.float() / 0.75) @ w
    torch.testing.assert_close(x.grad, expected, atol=1e-5, rtol=1e-4)


def test_recompute_option_keeps_the_eager_backward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    _train_side_by_side(model, lambda: (torch.randn(5, 8),), options={"training": "recompute"})
    assert _compiled_graphs() == {"stitchflow_0"}  # forward partitions only, named as in inference


def test_bad_training_option_is_named_and_the_model_still_runs():
    model = nn.Linear(4, 4)
    compiled = torch.compile(model, backend="stitchflow", options={"training": "sometimes"})
    x = torch.randn(3, 4)
    assert_close(compiled(x), model(x))
    assert "options['training'] must be 'compiled'" in backend.fallback_report()


def test_untraceable_graph_falls_back_to_the_recomputed_backward(monkeypatch):
    """Where AOTAutograd fails, the reason is recorded and the gradients are still eager's."""
    def refuse(*args, **kwargs):
        raise RuntimeError("no fake-tensor rule for this op")

    monkeypatch.setattr("torch._dynamo.backends.common.aot_module_simplified", refuse)
    torch.manual_seed(0)
    _train_side_by_side(nn.Sequential(nn.Linear(6, 6), nn.ReLU()), lambda: (torch.randn(4, 6),), steps=2)
    assert "AOTAutograd could not trace the graph" in backend.fallback_report()
    assert "no fake-tensor rule for this op" in backend.fallback_report()


def test_inference_under_no_grad_does_not_use_aot_autograd(monkeypatch):
    calls = []
    real = training.compile_forward_and_backward
    monkeypatch.setattr(training, "compile_forward_and_backward", lambda *a: calls.append(1) or real(*a))
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    compiled = torch.compile(model, backend="stitchflow")
    with torch.no_grad():
        compiled(torch.randn(2, 4))
    assert calls == []
    compiled(torch.randn(2, 4))  # grad mode on, parameters require grad: a new graph, through AOTAutograd
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generated_gpu_kernels_train_like_eager(dtype):
    """The gpu target's generated kernels (on CUDA, or under TRITON_INTERPRET=1 on the CPU) for the
    forward and the backward: layer norm's gradient rows, the bias gradients' column sums, GELU's
    derivative, RMS norm's."""
    skip_unless_kernels_run("gpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 20), nn.LayerNorm(20), nn.GELU(), nn.Linear(20, 6), nn.RMSNorm(6))
    model = model.to(DEVICE, dtype)
    _train_side_by_side(model, lambda: (torch.randn(7, 12, device=DEVICE, dtype=dtype),), steps=2,
                        options={"target": "gpu"}, exact=dtype == torch.bfloat16)
    assert _compiled_graphs() == {"forward", "backward"}


class _TinyLanguageModel(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, d), nn.Embedding(12, d)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids, targets):
        pos = torch.arange(ids.shape[1], device=ids.device)
        logits = self.head(self.norm(self.tokens(ids) + self.positions(pos)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_embeddings_and_cross_entropy_train_wholly_through_stitchflow():
    """ATen's embedding takes the weight first; its gradient is an accumulating index_put (rows summed
    into the table), cross-entropy's a scatter of -1 at the targets: both lower."""
    torch.manual_seed(0)
    _train_side_by_side(_TinyLanguageModel(), lambda: (torch.randint(0, 40, (3, 9)), torch.randint(0, 40, (3, 9))),
                        loss=lambda out: out)
    assert _compiled_graphs() == {"forward", "backward"}
    assert backend.fallback_report().endswith("everything captured ran through stitchflow")


_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU("tanh"), "silu": nn.SiLU,
                "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "softplus": nn.Softplus, "leaky_relu": nn.LeakyReLU,
                "elu": nn.ELU, "hardswish": nn.Hardswish, "mish": nn.Mish}
_NORMS = {"none": None, "layer": nn.LayerNorm, "rms": nn.RMSNorm, "layer_no_affine": lambda d: nn.LayerNorm(d, elementwise_affine=False)}


@settings(max_examples=12, deadline=None)
@given(widths=st.lists(st.integers(1, 23), min_size=2, max_size=4), rows=st.integers(1, 9),
       activation=st.sampled_from(sorted(_ACTIVATIONS)), norm=st.sampled_from(sorted(_NORMS)), bias=st.booleans(),
       head=st.sampled_from(["none", "softmax", "log_softmax"]))
def test_random_mlps_get_eagers_gradients(widths, rows, activation, norm, bias, head):
    """Random widths (1 and odd sizes among them), activations, norms and heads: every decomposed
    backward (AOTAutograd's) against eager's, judged against float64 like the other float32 cases."""
    torch._dynamo.reset()
    backend.reset()
    torch.manual_seed(len(widths) * 100 + rows)
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b, bias=bias), _ACTIVATIONS[activation]()]
        if _NORMS[norm] is not None:
            layers.append(_NORMS[norm](b))
    if head != "none":
        layers.append(nn.Softmax(-1) if head == "softmax" else nn.LogSoftmax(-1))
    _train_side_by_side(nn.Sequential(*layers), lambda: (torch.randn(rows, widths[0]),), steps=1, exact=True)
    assert "backward" in _compiled_graphs()


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("pool, shape", [
    (lambda: nn.MaxPool2d(3, 2, 1), (2, 3, 9, 9)),  # ResNet's stem: overlapping, padded windows
    (lambda: nn.MaxPool2d(2, ceil_mode=True), (2, 3, 8, 7)),
    (lambda: nn.MaxPool3d(2, 1), (1, 2, 4, 5, 5)),
    (lambda: nn.MaxPool2d(3, 1, 1), (3, 6, 6)),  # no batch dim
], ids=["stem", "ceil", "3d", "unbatched"])
def test_max_pool_gradient_gathers_at_the_argmax(pool, shape, target):
    skip_unless_kernels_run(target)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(shape[-1], shape[-1]), pool()).to(DEVICE if target == "gpu" else "cpu")
    device = next(model.parameters()).device
    _train_side_by_side(model, lambda: (torch.randn(*shape, device=device),), steps=1, options={"target": target})
    assert backend.fallback_report().endswith("everything captured ran through stitchflow")


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("scale", [2, 3])
def test_nearest_upsampling_gradient_sums_windows_without_a_scatter(scale, target):
    """AOTAutograd saves nearest upsampling's source rows (arange(s·n) // s) for the backward, which read
    them as data and scattered the gradient through torch. The backward now computes them itself
    (`training.recompute_constants`), and the scatter-add over them becomes a sum of s x s windows
    (rewrites.window_scatters): every region runs through stitchflow, gradients as eager's."""
    skip_unless_kernels_run(target)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), nn.Upsample(scale_factor=scale, mode="nearest"), nn.SiLU())
    model = model.to(DEVICE if target == "gpu" else "cpu")
    device = next(model.parameters()).device
    _train_side_by_side(model, lambda: (torch.randn(2, 3, 4, 5, device=device),), steps=1, options={"target": target})
    assert backend.fallback_report().endswith("everything captured ran through stitchflow")
    if target == "gpu":
        steps = [step for m in backend.COMPILED if m.name.startswith("backward") for p in m.programs.values() if p
                 for run in p._compiled for step in getattr(run, "steps", ())]
        assert steps and not any(getattr(getattr(step, "node", None), "is_scatter", False) for step in steps)


def _convolution_backward_masks(monkeypatch) -> list:
    """The output masks of the convolution backwards left in each backward graph, as compiled (after
    the partition hook's last rewrite)."""
    masks, taken = [], training.weight_gradients_as_gemms

    def recorded(backward):
        count = taken(backward)
        masks.extend(tuple(n.args[10]) for n in backward.graph.nodes
                     if n.target is torch.ops.aten.convolution_backward.default)
        return count

    monkeypatch.setattr(training, "weight_gradients_as_gemms", recorded)
    return masks


@pytest.mark.parametrize("target", ["reference", "gpu"])
def test_convolution_bias_gradients_are_sums_in_the_graph(target, monkeypatch):
    """A convolution backward's bias gradient (a plain and a transposed convolution, 2-d and 1-d) is
    taken out of it as a sum of the output's gradient over all but the channels, which stitchflow
    compiles: gradients as eager's, and every convolution_backward left asks for no bias gradient."""
    skip_unless_kernels_run(target)
    masks = _convolution_backward_masks(monkeypatch)
    torch.manual_seed(0)
    device = DEVICE if target == "gpu" else "cpu"
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.GroupNorm(2, 6), nn.SiLU(),
                          nn.ConvTranspose2d(6, 4, 2, stride=2), nn.Tanh()).to(device)
    _train_side_by_side(model, lambda: (torch.randn(2, 3, 5, 7, device=device),), steps=2, options={"target": target})
    assert len(masks) == 2 and all(mask[2] is False for mask in masks), masks
    fell_back = backend.fallback_report().splitlines()[1:]
    assert len(fell_back) == 2 and all("convolution_backward" in line for line in fell_back), fell_back
    masks.clear()
    line = nn.Conv1d(4, 5, 3).to(device)
    _train_side_by_side(line, lambda: (torch.randn(3, 4, 9, device=device),), steps=1, options={"target": target})
    assert masks == [(True, True, False)]


@pytest.mark.parametrize("conv, shape", [
    (lambda: nn.Conv2d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2), (2, 4, 9, 8)),
    (lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2), (2, 4, 5, 6)),
    (lambda: nn.Conv3d(3, 5, (2, 3, 3), padding=(0, 1, 1)), (2, 3, 4, 5, 6)),
])
def test_bias_gradients_of_other_convolutions_are_sums_too(conv, shape, monkeypatch):
    """Grouped, dilated, strided, transposed with output padding, 3-d: the sum over all but the
    channels is each one's bias gradient."""
    masks = _convolution_backward_masks(monkeypatch)
    torch.manual_seed(0)
    _train_side_by_side(nn.Sequential(conv(), nn.SiLU()), lambda: (torch.randn(*shape),), steps=1,
                        options={"target": "reference"})
    assert masks == [(True, True, False)]
    fell_back = backend.fallback_report().splitlines()[1:]
    assert len(fell_back) == 1 and "convolution_backward" in fell_back[0], fell_back


@pytest.mark.parametrize("target", ["reference", "gpu"])
def test_pointwise_convolution_weight_gradients_are_gemms(target, monkeypatch, fp32_convolutions):
    """A 1x1 convolution's weight gradient is one GEMM over every position (`pointwise_weight_gradient`),
    its input gradient still cuDNN's; a strided 1x1 convolution keeps its weight gradient in cuDNN."""
    skip_unless_kernels_run(target)
    masks = _convolution_backward_masks(monkeypatch)
    torch.manual_seed(0)
    device = DEVICE if target == "gpu" else "cpu"
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.SiLU(), nn.Conv2d(6, 5, 1), nn.GroupNorm(1, 5),
                          nn.Conv2d(5, 4, 1, stride=2, bias=False)).to(device)
    _train_side_by_side(model, lambda: (torch.randn(2, 3, 6, 7, device=device),), steps=2, options={"target": target})
    assert sorted(masks) == sorted([(True, True, False), (True, False, False), (True, True, False)]), masks
    fell_back = backend.fallback_report().splitlines()[1:]
    assert len(fell_back) == 3 and all("convolution_backward" in line for line in fell_back), fell_back


@pytest.mark.parametrize("grad_last", [False, True])
@pytest.mark.parametrize("x_last", [False, True])
def test_pointwise_weight_gradient_reads_either_layout(grad_last, x_last):
    from stitchflow.backend_layouts import pointwise_weight_gradient

    grad, x = torch.randn(3, 5, 4, 6, dtype=torch.float64), torch.randn(3, 7, 4, 6, dtype=torch.float64)
    grad = grad.contiguous(memory_format=torch.channels_last) if grad_last else grad
    x = x.contiguous(memory_format=torch.channels_last) if x_last else x
    torch.testing.assert_close(pointwise_weight_gradient(grad, x, (5, 7, 1, 1)),
                               torch.einsum("nchw,ndhw->cd", grad, x).view(5, 7, 1, 1))


@pytest.mark.parametrize("target", ["reference", "gpu"])
def test_thin_input_weight_gradients_are_gemms_over_unfolded_windows(target, monkeypatch, fp32_convolutions):
    """A convolution over an input of fewer than 8 channels whose window (channels x kernel) is no wider than
    its output's channels (an RGB stem) has its weight gradient as GEMMs over the unfolded windows
    (`unfolded_weight_gradient`), strided and dilated too; one whose window is wider keeps cuDNN's."""
    skip_unless_kernels_run(target)
    masks = _convolution_backward_masks(monkeypatch)
    torch.manual_seed(0)
    device = DEVICE if target == "gpu" else "cpu"
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.SiLU(),
                          nn.Conv2d(32, 2, 3, stride=2, padding=2, dilation=2), nn.SiLU(),
                          nn.Conv2d(2, 20, 3, stride=2, padding=1, bias=False), nn.SiLU(),
                          nn.Conv2d(20, 4, 1)).to(device)
    _train_side_by_side(model, lambda: (torch.randn(2, 3, 9, 10, device=device),), steps=2,
                        options={"target": target})
    assert sorted(masks) == sorted([(True, False, False), (True, True, False), (True, False, False),
                                    (True, False, False)]), masks


@pytest.mark.parametrize("x_last", [False, True])
@pytest.mark.parametrize("stride, padding, dilation", [((1, 1), (1, 1), (1, 1)), ((2, 1), (0, 2), (1, 2))])
def test_unfolded_weight_gradient_is_the_convolutions(x_last, stride, padding, dilation):
    from stitchflow.backend_layouts import unfolded_weight_gradient

    x, w = torch.randn(2, 3, 9, 8, dtype=torch.float64), torch.randn(6, 3, 3, 2, dtype=torch.float64)
    grad = torch.randn_like(torch.nn.functional.conv2d(x, w, None, stride, padding, dilation))
    expected = torch.nn.grad.conv2d_weight(x, w.shape, grad, stride, padding, dilation)
    x = x.contiguous(memory_format=torch.channels_last) if x_last else x
    grad = grad.contiguous(memory_format=torch.channels_last) if x_last else grad
    torch.testing.assert_close(unfolded_weight_gradient(grad, x, w.shape, stride, padding, dilation), expected)


@settings(max_examples=8, deadline=None)
@given(cin=st.integers(1, 6), cout=st.integers(1, 20), kernel=st.sampled_from([1, 3]), stride=st.integers(1, 2),
       bias=st.booleans(), side=st.integers(3, 7), last=st.booleans())
def test_random_convolutions_get_eagers_gradients(cin, cout, kernel, stride, bias, side, last):
    """Convolutions of any width, 1x1 or 3x3, strided or not, with or without a bias, on NCHW or
    channels-last inputs: whatever the partition hook takes out of their backward (bias sums, weight
    GEMMs over the input or its unfolded windows), the gradients are eager's."""
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=bias)

    def inputs():
        x = torch.randn(2, cin, side, side + 1)
        return (x.contiguous(memory_format=torch.channels_last) if last else x,)

    torch._dynamo.reset()
    _train_side_by_side(nn.Sequential(conv, nn.Tanh()), inputs, steps=1, options={"target": "reference"})


def test_gpu_target_on_cpu_without_the_interpreter(monkeypatch):
    """With no GPU and no interpreter the gpu target evaluates each part's nodes on the CPU, in the
    graph's order: relu's gradient reads a zero (a constant the kernels fold) that a later part
    made, and the backward had failed on its first call (and run eagerly)."""
    import stitchflow.targets.gpu.runtime as runtime

    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
    _train_side_by_side(model, lambda: (torch.randn(2, 3, 9, 9),), steps=1, options={"target": "gpu"})
    assert "failed" not in backend.fallback_report()


def test_like_gradient_converts_only_an_input_behind_a_channels_last_gradient():
    from stitchflow.backend_layouts import like_gradient

    x = torch.randn(2, 3, 6, 5)
    last = torch.randn(2, 8, 6, 5).contiguous(memory_format=torch.channels_last)
    moved = like_gradient(x, last)
    assert moved.is_contiguous(memory_format=torch.channels_last) and torch.equal(moved, x)
    assert like_gradient(x, last.contiguous()) is x
    unbatched = x[0]  # 3 dims: no channels-last format to convert to
    assert like_gradient(unbatched, last[0]) is unbatched


@pytest.mark.parametrize("target", ["gpu"])
def test_a_first_convolution_reads_its_input_in_its_gradients_layout(target, fp32_convolutions, monkeypatch):
    """The user's NCHW image meets a channels-last gradient at the first convolution's backward:
    the backward graph converts the image (cheap, 3 channels) instead of ATen converting the gradient
    and cuDNN both back. Gradients, the image's among them, equal eager's."""
    import stitchflow.backend_layouts as layouts

    skip_unless_kernels_run(target)
    seen, original = [], layouts.like_gradient

    def counting(x, grad):
        out = original(x, grad)
        seen.append(out is not x)
        return out

    monkeypatch.setattr(layouts, "LAYOUT_FREE", layouts.LAYOUT_FREE | {counting})
    monkeypatch.setattr(layouts, "like_gradient", counting)
    monkeypatch.setattr(backend, "like_gradient", counting)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).to(DEVICE)
    _train_side_by_side(model, lambda: (torch.randn(4, 3, 10, 10, device=DEVICE),), steps=2, exact=True,
                        options={"target": target})
    assert any(seen), "no convolution backward read its input converted"


@pytest.mark.parametrize("target", ["gpu"])
def test_a_cnns_training_step_keeps_its_activations_channels_last(target, fp32_convolutions):
    """The forward hands the backward its saved activations channels last (they leave as permuted
    views, no copy back to eager's strides); the backward reads them as stored and hands the eager
    convolution backwards its gradients channels last too. Gradients equal eager's (float64 judged;
    cuDNN's TF32 off, which it takes for channels-last float32 convolutions and not for NCHW ones)."""
    skip_unless_kernels_run(target)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 5)).to(DEVICE)
    _train_side_by_side(model, lambda: (torch.randn(4, 3, 10, 10, device=DEVICE),), steps=2, exact=True,
                        options={"target": target})
    programs = {m.name: p for m in backend.COMPILED for p in m.programs.values() if p is not None}
    forward = [p for name, p in programs.items() if name.startswith("forward")]
    backward = [p for name, p in programs.items() if name.startswith("backward")]
    saved = {name for p in forward for name in p.captured.layouts if name in p.graph.outputs}
    assert saved, "no activation left the forward channels last"
    read = {name for p in backward for name in p.captured.layouts if name in p.graph.inputs}
    assert read, "no backward partition read its inputs as stored"
    assert any(name in p.graph.outputs for p in backward for name in p.captured.layouts)


def test_weights_follow_their_gradients_layout_and_are_stored_channels_last_once():
    from stitchflow.backend_layouts import weight_like_gradient, weights_channels_last

    w = torch.randn(8, 3, 3, 3)
    (last,) = weights_channels_last(w)
    assert last.is_contiguous(memory_format=torch.channels_last) and torch.equal(last, w)
    assert weights_channels_last(last)[0] is last
    nhwc = torch.randn(2, 8, 6, 5).contiguous(memory_format=torch.channels_last)
    assert weight_like_gradient(last, nhwc) is last
    assert weight_like_gradient(w, nhwc).is_contiguous(memory_format=torch.channels_last)
    back = weight_like_gradient(last, nhwc.contiguous())  # an NCHW gradient: the weight goes back to NCHW
    assert back.is_contiguous() and torch.equal(back, w)
    assert weight_like_gradient(w, nhwc.contiguous()) is w
    assert weight_like_gradient(w[:, :, 0], nhwc[:, :, 0]) is not None  # 3 dims: no channels-last format


def test_a_convolution_reads_a_weight_in_its_inputs_format():
    from stitchflow.targets.gpu.conv import _weight

    w = torch.randn(8, 3, 3, 3)
    x_last = torch.randn(2, 3, 6, 5).contiguous(memory_format=torch.channels_last)
    moved = _weight(w, x_last, None)
    assert moved.is_contiguous(memory_format=torch.channels_last) and torch.equal(moved, w)
    back = _weight(moved, x_last.contiguous(), {})
    assert back.is_contiguous() and torch.equal(back, w)
    assert _weight(w, x_last.contiguous(), None) is w and _weight(moved, x_last, None) is moved


@pytest.mark.parametrize("target", ["gpu"])
def test_a_training_step_converts_each_convolution_weight_once(target, fp32_convolutions, monkeypatch):
    """The forward converts each convolution weight it saves for the backward to channels last once,
    its convolutions read that copy, and the backward's convolution backwards get it as stored (no
    conversion there). Gradients and the parameters after SGD steps equal eager's."""
    import stitchflow.backend_layouts as layouts

    skip_unless_kernels_run(target)
    converted, matched, original = [], [], layouts.weight_like_gradient

    def counting(w, grad):
        out = original(w, grad)
        matched.append(out is w and w.is_contiguous(memory_format=torch.channels_last))
        return out

    monkeypatch.setattr(layouts, "LAYOUT_FREE", layouts.LAYOUT_FREE | {counting})
    monkeypatch.setattr(layouts, "weight_like_gradient", counting)
    monkeypatch.setattr(backend, "weight_like_gradient", counting)
    monkeypatch.setattr(backend, "saved_weights_channels_last",
                        lambda gm, saved_from: converted.append(layouts.saved_weights_channels_last(gm, saved_from)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 6, 1), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten()).to(DEVICE)
    _train_side_by_side(model, lambda: (torch.randn(4, 3, 10, 10, device=DEVICE),), steps=2, exact=True,
                        options={"target": target})
    assert converted == [3], converted
    assert matched and all(matched), "a convolution backward's weight was not channels last as the forward saved it"
