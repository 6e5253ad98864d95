"""options["check_kernels"]: every generated kernel's call checked against the reference
interpreter; a kernel that differs raises KernelMismatch naming it (under TRITON_INTERPRET=1)."""

import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("STITCHFLOW_CACHE", tempfile.mkdtemp(prefix="stitchflow-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import stitchflow  # noqa: E402
from stitchflow.ir.errors import KernelMismatch  # noqa: E402
from stitchflow.targets.gpu.runtime import Launch  # noqa: E402
from conftest import skip_unless_kernels_run  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _layer_norm_gelu(x, w):
    return F.gelu(F.layer_norm(x, (x.shape[-1],), w)) * 2.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_correct_kernels_pass_the_check(dtype):
    skip_unless_kernels_run()
    x, w = torch.randn(5, 37, device=DEVICE).to(dtype), torch.randn(37, device=DEVICE).to(dtype)
    prog = stitchflow.compile(_layer_norm_gelu, (x, w), target="gpu", options={"check_kernels": True})
    torch.testing.assert_close(prog(x, w), _layer_norm_gelu(x, w), rtol=3e-2, atol=3e-2)
    assert any(k.check for run in prog._compiled for k in run.kernels)


def test_rounding_noise_is_not_a_mismatch():
    """A sum that cancels to rounding noise (a softmax gradient's row sum in BERT's backward) is as
    far from float64 in the kernel as in the interpreter: not flagged, though its error is the
    size of the output itself."""
    skip_unless_kernels_run()
    x = torch.randn(300, 64, device=DEVICE) * 100
    prog = stitchflow.compile(lambda x: (x - x.mean(0)).sum(0), (x,), target="gpu", fusion="full",
                              options={"check_kernels": True})
    out = prog(x)
    assert out.abs().max() < 1e-2


def test_a_wrong_kernel_is_named(monkeypatch):
    skip_unless_kernels_run()
    x, w = torch.randn(5, 37, device=DEVICE), torch.randn(37, device=DEVICE)
    prog = stitchflow.compile(_layer_norm_gelu, (x, w), target="gpu", options={"check_kernels": True})
    launch = Launch.__call__

    def off_by_one(self, env):  # a miscompile: every output one too large
        launch(self, env)
        for name in self.spec.outputs:
            env[name] = env[name] + 1

    monkeypatch.setattr(Launch, "__call__", off_by_one)
    with pytest.raises(KernelMismatch, match="differs from the reference interpreter") as caught:
        prog(x, w)
    assert "def " in caught.value.source  # the kernel's source comes with it


def test_the_check_is_off_by_default():
    skip_unless_kernels_run()
    x, w = torch.randn(5, 37, device=DEVICE), torch.randn(37, device=DEVICE)
    prog = stitchflow.compile(_layer_norm_gelu, (x, w), target="gpu")
    assert not any(k.check for run in prog._compiled for k in run.kernels)


def test_the_backend_raises_a_mismatch_instead_of_running_eagerly(monkeypatch, fresh_dynamo):
    """A program whose first call fails runs eagerly; a KernelMismatch the user asked for is raised."""
    skip_unless_kernels_run()
    launch = Launch.__call__

    def off_by_one(self, env):
        launch(self, env)
        for name in self.spec.outputs:
            env[name] = env[name] + 1

    monkeypatch.setattr(Launch, "__call__", off_by_one)
    fn = torch.compile(lambda x: F.gelu(x) * 2.0, backend="stitchflow",
                       options={"target": "gpu", "check_kernels": True})
    with pytest.raises(KernelMismatch):
        fn(torch.randn(4, 8, device=DEVICE))
