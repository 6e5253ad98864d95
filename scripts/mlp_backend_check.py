"""Device check: nn.Linear(64, 256) → GELU → nn.Linear(256, 64) in bf16 on 65536 rows, timed (CUDA
graphs) under eager, torch.compile and torch.compile(backend="stitchflow"); plus the wgmma device checks."""
import torch
from torch import nn

import stitchflow
from stitchflow.bench.chains_checks import wgmma_checks
from stitchflow.targets.gpu.timing import graph_bench

from triton.testing import do_bench

if "--checks" in __import__("sys").argv:
    for c in wgmma_checks():
        print(f"check {c['check']}: {c['rel_err']:.1e} {'ok' if c['ok'] else 'FAIL ' + c.get('error', '')}")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda().bfloat16()
x = torch.randn(65536, 64, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    ref = model(x)
    runs = {"eager": model, "torch.compile": torch.compile(model),
            "backend=stitchflow": torch.compile(model, backend="stitchflow")}
    for name, fn in runs.items():
        err = ((fn(x).float() - ref.float()).norm() / ref.float().norm()).item()
        print(f"{graph_bench(lambda: fn(x))[0] * 1e6:7.1f} us  err {err:.1e}  {name}", flush=True)
    # stitchflow.compile keeps its own CUDA graph (it cannot be captured again): plain calls, all three
    prog = stitchflow.compile(model, [x], target="gpu", fusion="auto")
    plans = [p for run in prog._compiled for step in run.steps if isinstance(getattr(step, "plans", None), dict)
             for p in step.plans.values()]
    print("chain plans:", [str(p) for p in plans])
    for name, fn in (("eager", lambda: model(x)), ("torch.compile", lambda: runs["torch.compile"](x)),
                     ("stitchflow.compile", lambda: prog(x))):
        fn()
        print(f"{do_bench(fn, warmup=50, rep=300, return_mode='median') * 1e3:7.1f} us plain calls  {name}", flush=True)
