"""Device probe: the 65536x64->256->64 chain kernel timed as the chains bench times it (graph_bench: CUDA-graph replays,
each after a clean L2 flush), five times in a row and five times after the GPU idled 0.5 s, with the SM clock read by
nvidia-smi every 20 ms in the background (written to the file given, default smi.csv). Shows whether the kernel is
timed at the full clock or at the power cap (BENCHMARKS.md, "Hugging Face models at one clock"). Not a test.

    PYTHONPATH=. python scripts/chain_clock_probe.py [out.csv]
"""
import subprocess
import sys
import time

import torch

from stitchflow.targets.gpu.chain_wgmma import WgmmaTiles, chain_wgmma
from stitchflow.targets.gpu.timing import graph_bench


def main():
    log = sys.argv[1] if len(sys.argv) > 1 else "smi.csv"
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active",
                            "--format=csv", "-lms", "20"], stdout=open(log, "w"))
    torch.manual_seed(0)
    a = torch.randn(65536, 64, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(64, 256, device="cuda") / 8).to(torch.bfloat16)
    d = (torch.randn(256, 64, device="cuda") / 16).to(torch.bfloat16)
    tiles = WgmmaTiles(64, 128, 4, 2, 2, 2)
    try:
        for pause in (0.0, 0.5):
            for _ in range(5):
                if pause:
                    torch.cuda.synchronize()
                    time.sleep(pause)
                start = time.time()
                seconds, how = graph_bench(lambda: chain_wgmma(a, b, d, act="gelu", tiles=tiles))
                print(f"pause {pause:.1f} s: {seconds * 1e6:6.2f} us ({how})  unix {start:.2f}-{time.time():.2f}",
                      flush=True)
    finally:
        smi.terminate()


if __name__ == "__main__":
    main()
