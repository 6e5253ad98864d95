"""Device probe: does a loaded host corrupt the autotuner's kernel times? Times one kernel (torch's layer norm
of a 8192x4096 bf16 tensor) with targets/gpu/timing.timed_median as it is, and with the calls timed plainly
(events around each call, no check that the GPU did not wait for the host: the timing before session 26),
with the host idle, beside 2 threads spinning in Python (they take the GIL, as compile threads do; 16 starve the
main thread for minutes), and beside N spinning processes. Not a test.

    python scripts/timing_contention_probe.py [N]
"""
import multiprocessing
import os
import statistics
import sys
import threading

import torch

from stitchflow.targets.gpu import timing


def plain_median(fn, reps: int = 200) -> float:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        timing._clean_l2_flush()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends))


def _spin(stop=None, parent=None) -> int:
    """Keep a core busy, and in a thread the GIL, until `stop` is set; in a process, until terminated or
    orphaned (a parent killed by `timeout` does not stop its daemon children: sixteen left spinning once
    slowed a later benchmark's runners)."""
    turns = 0
    while (stop is None or not stop.is_set()) and (turns % (1 << 20) or parent is None or os.getppid() == parent):
        turns += 1
    return turns


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    fn = lambda: torch.nn.functional.layer_norm(x, (4096,))  # noqa: E731
    for label in ("idle host", "2 Python threads spinning", f"{n} processes spinning"):
        stop, helpers = threading.Event(), []
        if "threads" in label:
            helpers = [threading.Thread(target=_spin, args=(stop,), daemon=True) for _ in range(2)]
        elif "processes" in label:
            helpers = [multiprocessing.Process(target=_spin, args=(None, os.getpid()), daemon=True) for _ in range(n)]
        for h in helpers:
            h.start()
        guarded = [timing.timed_median(fn) * 1e6 for _ in range(3)]
        plain = [plain_median(fn) * 1e6 for _ in range(3)]
        stop.set()
        for h in helpers:
            if isinstance(h, multiprocessing.Process):
                h.terminate()
            h.join()
        print(f"{label}: timed_median {' / '.join(f'{t:.1f}' for t in guarded)} us; "
              f"plain events {' / '.join(f'{t:.1f}' for t in plain)} us", flush=True)


if __name__ == "__main__":
    main()
