"""Device probe: does any generated kernel differ from the reference interpreter? Runs each case with
options={"check_kernels": True} (no CUDA graphs, first configs untimed) and prints the first KernelMismatch of each
with the kernel's source; how the Triton miscompile of scripts/triton_div_probe.py was found. Cases: a ceil-mode
max pool's training step, and the zoo's apps at their small size, inference through stitchflow.compile and a
training step through torch.compile(backend="stitchflow"), in bf16 and fp32. Not a test.

    python scripts/kernel_check_probe.py [case ...]      (default: all; a case is maxpool_ceil or APP:infer|train)

On a machine without a GPU, `TRITON_INTERPRET=1 STITCHFLOW_PROBE_DEVICE=cpu` runs the same sweep on CPU tensors
under Triton's interpreter (codegen logic, not the GPU compiler).
"""
import os
import sys
import time

import torch
from torch import nn

import stitchflow
from stitchflow.apps import APPS
from stitchflow.bench.training import training_case
from stitchflow.ir.errors import KernelMismatch

OPTIONS = {"check_kernels": True, "cuda_graphs": False, "autotune": False}
DEVICE = os.environ.get("STITCHFLOW_PROBE_DEVICE", "cuda")


def maxpool_ceil(dtype):
    model = nn.Sequential(nn.Linear(7, 7), nn.MaxPool2d(2, ceil_mode=True)).to(DEVICE, dtype)
    x = torch.randn(2, 3, 8, 7, device=DEVICE, dtype=dtype, requires_grad=True)
    return model, (x,), None


def train(case, dtype):
    model, inputs, upstream = maxpool_ceil(dtype) if case == "maxpool_ceil" else \
        training_case(case, dtype, "small", DEVICE, 0)
    fn = torch.compile(model, backend="stitchflow", options={"target": "gpu", "training": "compiled", **OPTIONS})
    out = fn(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(upstream if upstream is not None else torch.ones_like(out))


def infer(app, dtype):
    model, inputs = APPS[app].build(size="small", dtype=dtype)
    model = model.to(DEVICE)
    inputs = tuple(x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in inputs)
    with torch.no_grad():
        stitchflow.compile(model, inputs, target="gpu", options=OPTIONS)(*inputs)


def main():
    cases = sys.argv[1:] or ["maxpool_ceil"] + [f"{app}:{mode}" for app in APPS for mode in ("infer", "train")]
    for case in cases:
        for dtype in (torch.bfloat16, torch.float32):
            torch.manual_seed(0)
            torch._dynamo.reset()
            start = time.perf_counter()
            app, _, mode = case.partition(":")
            try:
                (infer if mode == "infer" else train)(app, dtype)
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                verdict = "every generated kernel equals the reference interpreter"
            except KernelMismatch as mismatch:
                verdict = f"MISMATCH {mismatch}\n{mismatch.source[mismatch.source.find('def _part0'):]}"
            except Exception as err:  # noqa: BLE001  (a probe: report and go on)
                verdict = f"not checked: {type(err).__name__}: {str(err)[:300]}"
            print(f"{case} {str(dtype)[6:]} ({time.perf_counter() - start:.0f} s): {verdict}", flush=True)


if __name__ == "__main__":
    main()
