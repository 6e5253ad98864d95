"""CUDA-graph replay of whole gpu programs: fresh inputs on every call must give fresh, right
answers. Needs a CUDA GPU (CI has none; this runs on the lent GPU)."""

import pytest
import torch

import stitchflow
from stitchflow.apps import APPS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("app", ["bert", "llama"])
def test_replay_follows_new_inputs(app):
    model, inputs = APPS[app].build(size="small")
    model = model.cuda()
    inputs = [x.cuda() for x in inputs]
    prog = stitchflow.compile(model, inputs, target="gpu", fusion="auto", options={"cuda_graphs": "always"})
    with torch.no_grad():
        for call in range(5):
            fresh = [torch.randn_like(x) if x.is_floating_point() and x.dim() > 2 else x for x in inputs]
            torch.testing.assert_close(prog(*fresh), model(*fresh), rtol=2e-3, atol=2e-3)
    assert prog._replay.graph is not None, prog._replay.failed
