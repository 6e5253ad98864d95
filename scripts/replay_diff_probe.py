"""Device probe: every replay of a program's CUDA graph compared output by output with a plain
call on the same inputs (the small CNN's training step). Not a test."""
import copy

import torch
import torch.nn as nn

import stitchflow.replay as replay
from stitchflow import backend

original = replay.GraphReplay._replay


def checked(self, inputs):
    out = original(self, inputs)
    plain = self.run(inputs)
    for name in self.outputs:
        a, b = out[name], plain[name]
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            d = (a.float() - b.float()).abs().max().item()
            if d > 1e-6:
                print(f"   replay differs from plain: {name} {tuple(a.shape)} {a.dtype} by {d:.2e}")
    return out


replay.GraphReplay._replay = checked
torch.backends.cudnn.allow_tf32 = False
torch._dynamo.reset()
backend.reset()
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                      nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(16, 5)).cuda()
compiled = torch.compile(model, backend="stitchflow", options={"cuda_graphs": False})
for step in range(5):
    print("step", step)
    x = torch.randn(8, 3, 20, 20, device="cuda", requires_grad=True)
    compiled(x).square().mean().backward()
for m in backend.COMPILED:
    for prog in m.programs.values():
        if prog is not None:
            print(m.name, [type(s).__name__ + ":" + getattr(s, "title", "") for run in prog._compiled
                           for s in getattr(run, "steps", ())])
            print(prog.graph)
