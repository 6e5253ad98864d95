"""Device probe: where a Hugging Face model's inference time goes under each runner. For each model of
apps/hf.py (default size, bf16, CUDA): the stitchflow backend's fallback report and partitions, then the top CUDA
kernels by total time (torch.profiler, a few calls after warm-up) for eager, torch.compile and the stitchflow backend.
Not a test.

    python scripts/hf_models_probe.py [hf-gpt2,hf-llama:padded,hf-bert] [--train] [--runners eager,stitchflow]
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import stitchflow.backend as backend
from stitchflow.apps import build_model


def kernels(fn, inputs, calls=3, top=14, train=False):
    def step():
        out = fn(*inputs)
        if train:
            out.float().square().mean().backward()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))
    total = sum(getattr(e, "self_device_time_total", 0) for e in rows) / calls
    print(f"    device time per call {total:.0f} us; launches {sum(e.count for e in rows if getattr(e, 'self_device_time_total', 0) > 0) // calls}")
    for e in rows[:top]:
        t = getattr(e, "self_device_time_total", 0) / calls
        if t > 0:
            print(f"    {t:9.1f} us  x{e.count // calls:4d}  {e.key[:110]}")


def main():
    names = (sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "hf-gpt2,hf-llama,hf-bert").split(",")
    train = "--train" in sys.argv
    runners = ("eager", "torch.compile", "stitchflow")
    if "--runners" in sys.argv:
        runners = sys.argv[sys.argv.index("--runners") + 1].split(",")
    for spec in names:
        name, _, size = spec.partition(":")
        model, inputs = build_model(name, size or "default", dtype=torch.bfloat16)
        model = model.cuda().train(train)
        inputs = tuple(x.cuda() for x in inputs)
        print(f"== {spec} {'training' if train else 'inference'}", flush=True)
        for runner in runners:
            torch._dynamo.reset()
            backend.reset()
            fn = (model if runner == "eager" else torch.compile(model, dynamic=False) if runner == "torch.compile"
                  else torch.compile(model, backend="stitchflow", dynamic=False))
            print(f"  -- {runner}", flush=True)
            with torch.set_grad_enabled(train):
                kernels(fn, inputs, train=train)
            if runner == "stitchflow":
                print("   ", backend.fallback_report().replace("\n", "\n    ")[:3000])
                for m in backend.COMPILED:
                    progs = [p for p in m.programs.values() if p is not None]
                    print(f"    partition {m.name}: {len(m.gm.graph.nodes)} nodes, programs {len(progs)}, "
                          f"regions {[len(p.regions) for p in progs]}, split {bool(m.split)}")


if __name__ == "__main__":
    main()
