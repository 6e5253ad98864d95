"""Device probe: the zoo's small ResNet trained under torch.compile(backend="stitchflow") beside eager, the
loss difference per step, with the whole-graph replay on and off. Not a test."""
import copy
import sys

import torch

from stitchflow import backend
from stitchflow.apps import APPS
from stitchflow.replay import AOT_REPLAYS


def run(options):
    torch._dynamo.reset()
    backend.reset()
    model, (example,) = APPS["resnet"].build(size="small")
    model = model.cuda().train()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="stitchflow", options=options)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, reference)]
    for step in range(7):
        x = torch.randn(8, *example.shape[1:], device="cuda")
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        outs = [f(v) for f, v in zip((compiled, reference), xs)]
        losses = [o.square().mean() for o in outs]
        for loss in losses:
            loss.backward()
        pdiff = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
        bdiff = max((p - q).abs().max().item() for p, q in zip(model.buffers(), reference.buffers()))
        print(f"step {step}: loss {losses[0].item():.6f} vs {losses[1].item():.6f}, out diff "
              f"{(outs[0] - outs[1]).abs().max().item():.2e}, x grad diff {(xs[0].grad - xs[1].grad).abs().max().item():.2e}"
              f", param grad diff {pdiff:.2e}, buffer diff {bdiff:.2e}")
        for opt in opts:
            opt.step(), opt.zero_grad()
    for r in AOT_REPLAYS:
        rp = r.replay
        print(" replay", rp.calls, rp.graph is not None, rp.failed, "handed", len(rp.handed_over), "borrowed",
              len(rp.borrowed), "slots", len(rp.slots), "plain calls", rp.plain_calls)


torch.backends.cudnn.allow_tf32 = False
for options in ({"cuda_graphs": False}, {}):
    print(options)
    run(options)
    sys.stdout.flush()
