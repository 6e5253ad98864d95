"""Shared fixtures: seeded generators, sparse matrices of several densities, tolerances."""

import dataclasses
import json
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # CI has no GPU: Triton kernels run on the CPU

import pytest
import torch

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


def eager_gives_nothing(fn, *inputs) -> bool:
    """Eager refuses the arguments (a RuntimeError) or returns an empty tensor: the cases stitchflow
    must refuse too (zero-size tensors are unsupported by design)."""
    try:
        out = fn(*inputs)
    except RuntimeError:
        return True
    return any(t.numel() == 0 for t in (out if isinstance(out, tuple) else (out,)))


def random_sparse(rows, cols, density, *, generator=None, dtype=torch.float32):
    """A dense matrix with about `density` of its entries non-zero (values away from zero)."""
    g = generator or torch.Generator().manual_seed(0)
    mask = torch.rand(rows, cols, generator=g) < density
    vals = torch.rand(rows, cols, generator=g, dtype=torch.float64).to(dtype) + 0.5
    return torch.where(mask, vals, torch.zeros((), dtype=dtype))


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


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

