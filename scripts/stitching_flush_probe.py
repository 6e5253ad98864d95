"""Device probe: the stitching bench's numbers under the two L2 flushes, in one process.

triton.testing.do_bench zeroes 256 MB before each timed call, leaving L2 full of dirty lines whose
write-back to HBM lands in the timed call; `targets/gpu/timing.timed_median` reads 256 MB instead, so
the lines leave clean. For the copy that sets the ceiling (1 GiB, as the bench), a copy of each
pattern's own bytes, eager, torch.compile and stitchflow, this prints the median µs under both
flushes, the rounds alternating, and each pattern's share of the copy under each.

    PYTHONPATH=. python3 scripts/stitching_flush_probe.py [--patterns a,b] [--out probe.json]

Not a test."""
from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch
from triton.testing import do_bench

import stitchflow
from stitchflow.bench.stitching import _input_sets, _l2_bytes, _time
from stitchflow.bench.stitching_patterns import PATTERNS, as_tuple, min_bytes

ROUNDS = 3


def zeroing_us(fn, sets) -> float:
    cycle = itertools.cycle(sets)
    return do_bench(lambda: fn(*next(cycle)), warmup=10, rep=60, return_mode="median") * 1e3


TIMERS = {"zeroing flush (do_bench)": zeroing_us, "clean flush (timed_median)": _time}


def competitors(name: str) -> tuple[dict, list, int]:
    pat = PATTERNS[name]
    torch._dynamo.reset()
    sets = _input_sets(pat, pat.large, "cuda", _l2_bytes("cuda"))
    module = pat.module().cuda()
    with torch.no_grad():
        ref = module(*sets[0])
        prog = stitchflow.compile(module, sets[0], target="gpu", fusion="full", options={"cuda_graphs": False})
        fns = {"eager": module, "torch.compile": torch.compile(module, dynamic=False), "stitchflow": prog}
        for fn in fns.values():
            fn(*sets[0])
    nbytes = min_bytes(sets[0], as_tuple(ref))
    src = torch.empty(nbytes // 8, dtype=torch.float32, device="cuda")  # half the traffic read, half written
    dst = torch.empty_like(src)
    fns["copy of the same bytes"] = lambda *_: dst.copy_(src)
    return fns, sets, nbytes


def measure(fns: dict, sets) -> dict:
    times = {(who, how): [] for who in fns for how in TIMERS}
    with torch.no_grad():
        for _ in range(ROUNDS):
            for how, timer in TIMERS.items():
                for who, fn in fns.items():
                    times[who, how].append(timer(fn, sets))
    return {f"{who} | {how}": statistics.median(ts) for (who, how), ts in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--patterns", default="column_center,column_standardize,batchnorm_train,add_layernorm_gelu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    big = torch.empty(1 << 28, dtype=torch.float32, device="cuda").normal_()
    big_dst = torch.empty_like(big)
    copy = measure({"copy 1 GiB": lambda *_: big_dst.copy_(big)}, [()])
    del big, big_dst
    result = {"device": torch.cuda.get_device_name(), "copy": copy, "patterns": {}}
    copy_bw = {how: 2 * (1 << 30) / (copy[f"copy 1 GiB | {how}"] * 1e-6) for how in TIMERS}
    for how, bw in copy_bw.items():
        print(f"copy 1 GiB, {how}: {copy[f'copy 1 GiB | {how}']:.1f} us = {bw / 1e12:.3f} TB/s", flush=True)
    for name in args.patterns.split(","):
        fns, sets, nbytes = competitors(name)
        us = measure(fns, sets)
        result["patterns"][name] = {"bytes": nbytes, "us": us}
        for key, t in us.items():
            how = key.split(" | ")[1]
            share = nbytes / (t * 1e-6) / copy_bw[how]
            print(f"{name:20s} {key:55s} {t:8.1f} us  {share:6.1%} of copy", flush=True)
        del fns, sets
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
