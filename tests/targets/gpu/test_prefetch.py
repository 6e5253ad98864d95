"""A program's kernels compiled ahead of its first call (targets/gpu/prefetch.py): the walk on meta
tensors must foresee the signature each generated kernel's call sees (strides after torch's ops,
permuted inputs, convolutions channels last), so that the call takes the launch whose compiles were
queued. On the CPU the walk runs without compiling (the interpreter compiles nothing); on a GPU the
compiles are queued and the results must equal eager's."""

import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("STITCHFLOW_CACHE", tempfile.mkdtemp(prefix="stitchflow-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import stitchflow  # noqa: E402
from stitchflow.bench.stitching_patterns import PATTERNS  # noqa: E402
from stitchflow.targets.gpu import compiles, runtime  # noqa: E402
from stitchflow.targets.gpu.prefetch import MetaEnv, meta_like, walk  # noqa: E402

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if ON_GPU else "cpu"


def _norm_gemm_norm(x, w):
    y = F.gelu(F.layer_norm(x, x.shape[-1:]))
    return F.gelu(F.layer_norm(y @ w, x.shape[-1:]))


def _transposed_softmax(x, w):
    s = (x @ w).transpose(0, 1) * 0.5  # a kernel reads the GEMM's output through a transposed view
    return torch.softmax(s, dim=-1) + x.sum(0)[:, None]


class _ConvBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + y).mean((2, 3))


def _cases():
    torch.manual_seed(0)
    x, w = torch.randn(6, 40, device=DEVICE), torch.randn(40, 40, device=DEVICE)
    yield "norm_gemm_norm", _norm_gemm_norm, (x, w)
    xt = torch.randn(24, 10, device=DEVICE).t()  # a transposed input
    yield "transposed_softmax", _transposed_softmax, (xt, torch.randn(24, 24, device=DEVICE))
    block = _ConvBlock().to(DEVICE).eval()
    yield "conv_block", block, (torch.randn(2, 3, 9, 7, device=DEVICE),)
    pattern = PATTERNS["column_standardize"]  # split over programs: partials in scratch buffers
    yield "column_split", pattern.module(), pattern.make((6000, 40), torch.float32, DEVICE,
                                                          torch.Generator().manual_seed(0))


OPTIONS = {"column_split": {"split": 4}}


def _kernels(prog):
    return [k for run in prog._compiled for k in run.kernels]


@pytest.mark.parametrize("name", [c[0] for c in _cases()])
def test_the_walk_foresees_every_kernels_signature_and_the_call_takes_its_launch(name):
    _, fn, inputs = next(c for c in _cases() if c[0] == name)
    prog = stitchflow.compile(fn, list(inputs), target="gpu", fusion="full",
                              options={"cuda_graphs": False, "prefetch": False, **OPTIONS.get(name, {})})
    kernels = _kernels(prog)
    assert kernels, "the case must have generated kernels"
    walk(prog.graph, prog._compiled, prog._bind(inputs), torch.device(DEVICE))
    foreseen = {id(k): dict(k._prefetched) for k in kernels}
    assert all(len(f) == 1 for f in foreseen.values())
    with torch.no_grad():
        got, want = prog(*inputs), fn(*inputs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for k in kernels:
        (sig, (configs, launches)), = foreseen[id(k)].items()
        assert list(k._built) == [sig], f"{k.title}: the call saw {list(k._built)}, the walk foresaw {sig}"
        assert k._built[sig] is launches[0] and k.chosen == configs[0]
        assert not k._prefetched  # taken by the call
        # scratch and counters made for meta tensors are not kept (only the real device's)
        assert all(device.type == DEVICE for device, _ in launches[0].counters)


def test_meta_tensors_keep_strides_offsets_and_unknown_names_read_as_their_ir_type():
    base = torch.randn(5, 8)
    view = base[1:, 2:].t()
    meta = meta_like(view)
    assert meta.device.type == "meta" and meta.shape == view.shape and meta.stride() == view.stride()
    assert meta.storage_offset() == view.storage_offset() and meta.data_ptr() == 4 * view.storage_offset()
    prog = stitchflow.compile(_norm_gemm_norm, [torch.randn(6, 40), torch.randn(40, 40)], target="gpu",
                              fusion="full")
    env = MetaEnv(prog.graph, {})
    name = prog.graph.nodes[-1].name
    ty = prog.graph.type_of[name]
    assert env[name].shape == ty.shape and env[name].dtype == ty.dtype and env[name].is_contiguous()
    with pytest.raises(KeyError):
        env["no such tensor"]


def test_a_step_that_fails_on_meta_tensors_costs_nothing_but_its_guess(monkeypatch):
    x, w = torch.randn(6, 40, device=DEVICE), torch.randn(40, 40, device=DEVICE)
    prog = stitchflow.compile(_norm_gemm_norm, [x, w], target="gpu", fusion="full",
                              options={"cuda_graphs": False, "prefetch": False})
    from stitchflow.targets.gpu.grouping import TorchStep

    def broken(self, env):
        raise RuntimeError("no meta kernel")

    monkeypatch.setattr(TorchStep, "on_meta", broken)
    _, kernels = walk(prog.graph, prog._compiled, prog._bind((x, w)), torch.device(DEVICE))
    assert kernels == 2  # the kernel after the GEMM is still foreseen, from the GEMM's IR type
    torch.testing.assert_close(prog(x, w), _norm_gemm_norm(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not ON_GPU, reason="compiles are queued only on a CUDA GPU (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("name", [c[0] for c in _cases()])
def test_a_cold_first_call_with_prefetch_equals_eager(name, monkeypatch, tmp_path):
    monkeypatch.setenv("STITCHFLOW_CACHE", str(tmp_path))  # no cached choices: every space is tuned
    monkeypatch.setattr(runtime, "TUNE_MIN_BYTES", 0)
    _, fn, inputs = next(c for c in _cases() if c[0] == name)
    prog = stitchflow.compile(fn, list(inputs), target="gpu", fusion="full",
                              options={"cuda_graphs": False, **OPTIONS.get(name, {})})
    queued = []

    def spy(launches, env):
        queued.extend(launches)
        return compiles.submit(launches, env)

    monkeypatch.setattr(runtime, "submit", spy)
    with torch.no_grad():
        got, want = prog(*inputs), fn(*inputs)
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    built = [launch for k in _kernels(prog) for launch in k._built.values() if isinstance(launch, runtime.Launch)]
    assert built and all(any(launch is q for q in queued) for launch in built)  # each call's launch was queued
    for k in _kernels(prog):
        assert not k._prefetched and k.chosen is not None
        # the compiles queued on meta tensors made scratch for them, which no launch keeps
        assert all(device.type == "cuda" for launch in k._built.values() for device, _ in launch.counters)
