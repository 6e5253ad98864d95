"""Fixtures of the gpu target's tests."""

import json
import os
import subprocess
import sys

import pytest


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
