"""Device probe: does the order in which competitors are compiled in one process change a runner's time? The blocks
bench had padded Llama under the backend at 3485 µs while scripts/gpu_gaps_probe.py, in a process of its own, had
3148 µs for the same runner. Times each runner (stitching._time: medians over calls, L2 evicted clean) after the
other was compiled, in the order given. Not a test.

    PYTHONPATH=. python scripts/bench_order_probe.py hf-llama:padded [stitchflow,torch.compile,reduce-overhead] [--cooldown 0,0.5]
"""
import sys
import time

import torch

from stitchflow.apps import build_model
from stitchflow.bench.stitching import _time


def main():
    args = sys.argv[1:]
    name, _, size = (args[0] if args else "hf-llama:padded").partition(":")
    order = (args[1] if len(args) > 1 and not args[1].startswith("-") else "stitchflow,torch.compile").split(",")
    cooldowns = [float(c) for c in args[args.index("--cooldown") + 1].split(",")] if "--cooldown" in args else [0.0]
    model, inputs = build_model(name, size or "default", dtype=torch.bfloat16)
    model = model.cuda()
    inputs = tuple(x.cuda() for x in inputs)
    made = {}
    with torch.no_grad():
        for runner in order:
            if runner not in made:
                made[runner] = (torch.compile(model, dynamic=False) if runner == "torch.compile" else
                                torch.compile(model, mode="reduce-overhead", dynamic=False)
                                if runner == "reduce-overhead" else
                                torch.compile(model, backend="stitchflow", dynamic=False, options={"autotune": "all"}))
                for _ in range(3):
                    made[runner](*inputs)
            for cooldown in cooldowns:
                start = time.time()
                times = [_time(made[runner], [inputs], cooldown) for _ in range(3)]
                print(f"{runner:16s} cooldown {cooldown:4.2f} s " + " ".join(f"{t:8.1f}" for t in times)
                      + f"   (unix {start:.1f}-{time.time():.1f})", flush=True)


if __name__ == "__main__":
    main()
