"""Shared fixtures: seeded generators, sparse matrices of several densities, tolerances."""

import dataclasses
import json
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # CI has no GPU: Triton kernels run on the CPU
# plans are not read from disk: tests patch cost models and legality at run time, which a plan's key cannot see
# (tests/planner/test_plan_cache.py turns the cache on where it is the subject)
os.environ.setdefault("STITCHFLOW_PLAN_CACHE", "0")

import pytest
import torch
from hypothesis import settings

# The README's test command (and so CI) draws the same examples on every machine: a run that passes in a
# fresh clone here passes in CI. HYPOTHESIS_PROFILE=explore draws new examples each run, to hunt for bugs.
settings.register_profile("repeatable", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float64: dict(rtol=1e-9, atol=1e-12),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=5e-3, atol=5e-3)}


def assert_close(actual, expected, dtype=None):
    dtype = dtype or expected.dtype
    tol = TOL.get(dtype, dict(rtol=0, atol=0))
    if actual.layout != torch.strided:
        actual = actual.to_dense()
    if expected.layout != torch.strided:
        expected = expected.to_dense()
    torch.testing.assert_close(actual, expected, **tol, equal_nan=True)


def assert_close_to_truth(actual, fn, inputs):
    """`actual` equals eager `fn(*inputs)` where the output is float32 or wider. In half precision a fused
    kernel keeps intermediates in float32 where eager rounds each op, so where terms cancel the two may differ
    by an ulp of the largest intermediate. Inductor's rule then decides: against `fn` on float64 inputs,
    the compiled result's RMS error is at most twice eager's (plus a small floor)."""
    expected = fn(*inputs)
    try:
        return assert_close(actual, expected)
    except AssertionError:
        if expected.dtype not in (torch.bfloat16, torch.float16):
            raise
        truth = fn(*(t.double() if t.is_floating_point() else t for t in inputs)).double()
        rms = lambda t: (t.double() - truth).nan_to_num(posinf=0, neginf=0).pow(2).mean().sqrt().item()  # noqa: E731
        floor = TOL[expected.dtype]["atol"] / 10
        assert torch.equal(actual.isnan(), expected.isnan()), "NaN where eager has none, or the reverse"
        assert rms(actual) <= 2 * rms(expected) + floor, (
            f"error against float64 {rms(actual):.3g} exceeds twice eager's {rms(expected):.3g} + {floor:.3g}")


def dynamo_graph(fn, *inputs):
    """The graph Dynamo hands a backend for fn(*inputs), and the example inputs it passes."""
    seen = {}

    def grab(gm, example_inputs):
        seen.setdefault("gm", gm)
        seen.setdefault("inputs", list(example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=grab, dynamic=False)(*inputs)
    return seen["gm"], seen["inputs"]


def eager_gives_nothing(fn, *inputs) -> bool:
    """Eager refuses the arguments (a RuntimeError) or returns an empty tensor: the cases stitchflow
    must refuse too (zero-size tensors are unsupported by design)."""
    try:
        out = fn(*inputs)
    except RuntimeError:
        return True
    return any(t.numel() == 0 for t in (out if isinstance(out, tuple) else (out,)))


def twins(make):
    """Two copies of a model with the same parameters (seeded): one to compile, one to run eagerly beside it."""
    torch.manual_seed(0)
    ours, theirs = make(), make()
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def random_sparse(rows, cols, density, *, generator=None, dtype=torch.float32):
    """A dense matrix with about `density` of its entries non-zero (values away from zero)."""
    g = generator or torch.Generator().manual_seed(0)
    mask = torch.rand(rows, cols, generator=g) < density
    vals = torch.rand(rows, cols, generator=g, dtype=torch.float64).to(dtype) + 0.5
    return torch.where(mask, vals, torch.zeros((), dtype=dtype))


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and the backend's records cleared around a test of torch.compile(backend="stitchflow")."""
    from stitchflow import backend

    torch._dynamo.reset()
    backend.reset()
    yield
    torch._dynamo.reset()


def run_fresh(code: str, payload) -> object:
    """Run `code` in a fresh Python without TRITON_INTERPRET, `payload` as JSON on its stdin; its last
    stdout line parsed as JSON. Gluon's sm_90 compiles need this: Triton's interpreter, which the
    other tests of a session run, patches triton.language in place (nested jit calls never undo
    it), and Gluon's compiler then fails on the patched builtins."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(payload), capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def fp32_convolutions():
    """cuDNN's TF32 off for a test that compares float32 convolutions with eager's: cuDNN takes it for
    channels-last operands and not for NCHW ones. Through flags(), since OpInfo tests freeze the global flags."""
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=False, allow_tf32=False):
        yield


@pytest.fixture(scope="session")
def fresh_python():
    return run_fresh


@pytest.fixture(scope="session")
def compile_sm90(fresh_python):
    """compile_sm90(module, tiles_class, cases): each case (shape, tiles, act, bias, linear_weights)
    through `module`'s compile_for_sm90 in a fresh process; their resource reports, in order."""
    def run(module: str, tiles_class: str, cases) -> list[dict]:
        payload = [(shape, dataclasses.asdict(t), act, bias, linear) for shape, t, act, bias, linear in cases]
        code = ("import json, sys\n"
                f"from {module} import {tiles_class}, compile_for_sm90\n"
                "cases = json.loads(sys.stdin.read())\n"
                f"print(json.dumps([compile_for_sm90(*s, {tiles_class}(**t), act=a, bias=b, linear_weights=l)"
                " for s, t, a, b, l in cases]))\n")
        return fresh_python(code, payload)
    return run


def skip_unless_kernels_run(target: str = "gpu") -> None:
    """Generated kernels run on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (which CI sets): skip a gpu-target
    case elsewhere."""
    if target == "gpu" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("generated kernels run on CPU tensors only under TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def _planner_estimates_per_test():
    """The planner shares estimates of equal regions across graphs for the whole process (planner/ilp.py): each
    test starts without those of earlier tests, so that tests counting estimates do not depend on their order."""
    from stitchflow.planner import ilp

    ilp._SHAPES.clear()
