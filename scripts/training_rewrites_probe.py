"""Device probe: training steps of zoo models with and without the graph rewrites of session 39 (flattened rows
split back, written-out activations recognised), each in the training bench's method (bench/training.py: checked
against the float64 step, timed in rounds against eager and torch.compile in the same process).

    PYTHONPATH=. python scripts/training_rewrites_probe.py [--apps bert,llama]
"""
import argparse

import torch

from stitchflow.bench.training import bench_training

AS_WRITTEN = {"unflatten_rows": False, "recognise_activations": False}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--apps", default="bert,llama")
    args = ap.parse_args()
    for app in args.apps.split(","):
        for label, options in (("rewrites on", {}), ("as written", AS_WRITTEN)):
            row = bench_training(app, torch.bfloat16, runners=("torch.compile", "backend=stitchflow"), options=options)
            times = {k: v for k, v in row.items() if k.endswith(" us")}
            errors = {k: v for k, v in row.items() if "err" in k}
            print(f"{app} {label}: {times} {errors}", flush=True)


if __name__ == "__main__":
    main()
