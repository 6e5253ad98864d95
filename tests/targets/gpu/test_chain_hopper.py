"""The chain plans on a Hopper GPU, end to end: an nn.Linear → GELU → nn.Linear block compiled by
stitchflow (target="gpu") and by torch.compile(backend="stitchflow") equals eager, and the planner
runs it as one chain kernel. Needs an sm_90 GPU (CI has none; this runs on the lent GPU)."""

import pytest
import torch
from torch import nn

import stitchflow

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm_90) GPU")


def mlp(k=64, n=256, l=64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(k, n), nn.GELU(), nn.Linear(n, l)).cuda().bfloat16()


def chain_plans(prog):
    """The plans the chain steps (targets/gpu/chains.compile_chain) chose, by shape."""
    return [plan for run in prog._compiled for step in run.steps if isinstance(getattr(step, "plans", None), dict)
            for plan in step.plans.values()]


@pytest.mark.parametrize("rows", [65536, 1000])
def test_linear_gelu_linear_is_one_chain_kernel_equal_to_eager(rows):
    model = mlp()
    x = torch.randn(rows, 64, device="cuda", dtype=torch.bfloat16)
    prog = stitchflow.compile(model, [x], target="gpu", fusion="auto")
    with torch.no_grad():
        out, ref = prog(x), model(x)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    plans = chain_plans(prog)
    assert plans, "the block did not run as a chain"
    print("chain plans:", [str(p) for p in plans])


def test_backend_runs_the_block():
    model = mlp()
    x = torch.randn(4096, 64, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="stitchflow")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=2e-2, atol=2e-2)
