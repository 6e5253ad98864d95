"""Device probe: which generated kernel of a model's training step differs from the reference interpreter? Every
GroupKernel call is followed by the interpreter's evaluation of the same nodes on the same inputs; a kernel whose
outputs differ prints its plans, input strides and source. Not a test.

    python scripts/kernel_check_probe.py maxpool_ceil
"""
import sys

import torch
from torch import nn

import stitchflow.backend  # noqa: F401  (registers the backend)
from stitchflow.ir.interpret import eval_node
from stitchflow.targets.gpu.runtime import GroupKernel

MODELS = {"maxpool_ceil": (lambda: nn.Sequential(nn.Linear(7, 7), nn.MaxPool2d(2, ceil_mode=True)), (2, 3, 8, 7))}


def checked_call(original):
    def call(self, env):
        original(self, env)
        ref = dict(env)
        for plan in self.plans:
            for n in plan.nodes:
                ref[n.name] = eval_node(n, ref, self.graph.type_of[n.name])
        for plan in self.plans:
            for name in plan.outputs:
                got, want = env[name], ref[name]
                if not torch.allclose(got.float(), want.float(), rtol=1e-3, atol=1e-3, equal_nan=True):
                    print(f"MISMATCH {self.title} output {name}: max error {(got.float() - want.float()).abs().max()}")
                    print("  inputs:", [(t, tuple(env[t].shape), env[t].stride()) for t in self.inputs])
                    for launch in self._built.values():
                        print(launch.spec.source[launch.spec.source.index("def _part0"):])
    return call


def main():
    build, shape = MODELS[sys.argv[1] if len(sys.argv) > 1 else "maxpool_ceil"]
    GroupKernel.__call__ = checked_call(GroupKernel.__call__)
    torch.manual_seed(0)
    model = build().cuda()
    fn = torch.compile(model, backend="stitchflow", options={"target": "gpu", "training": "compiled",
                                                              "cuda_graphs": False})
    fn(torch.randn(*shape, device="cuda")).sum().backward()
    torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
