"""Device timing shared by the gpu target's autotuners and benches: CUDA-graph replays, each
after a clean L2 flush, median over repetitions."""

from __future__ import annotations

import logging
import statistics

import torch

log = logging.getLogger("stitchflow.gpu.timing")


_FLUSH_BUFFERS: dict = {}


def _clean_l2_flush():
    """Evict L2 by reading 256 MB. triton.testing.do_bench zeroes a buffer instead, which leaves L2
    full of dirty lines: a kernel that then streams its weights pays for writing ~50 MB of the
    flush's data back to HBM. On an H100 that added 9-10 µs to each 134 MB weight stream of the
    GPT-6.7B FFN (scripts/flush_probe.py), 20% of the kernel, for traffic that is not the kernel's."""
    device = torch.cuda.current_device()
    if device not in _FLUSH_BUFFERS:
        _FLUSH_BUFFERS[device] = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    _FLUSH_BUFFERS[device].sum()


def timed_median(fn, budget_s: float = 0.1) -> float:
    """Median seconds of `fn` over repetitions, each after a clean L2 flush (as do_bench, whose
    timing loop this follows, but with `_clean_l2_flush`)."""
    fn()
    torch.cuda.synchronize()
    probe = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    probe[0].record()
    for _ in range(5):
        fn()
    probe[1].record()
    torch.cuda.synchronize()
    per_call = max(probe[0].elapsed_time(probe[1]) / 5 * 1e-3, 1e-6)
    reps = max(20, min(1000, int(budget_s / per_call)))
    for _ in range(min(25, reps)):
        fn()
    return statistics.median(flushed_times(fn, reps))


def flushed_times(fn, reps: int) -> list[float]:
    """Seconds of each of `reps` calls of `fn` (CUDA events around it), each after a clean L2 flush."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        _clean_l2_flush()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)]


def graph_bench(fn, warmup: int = 2) -> tuple[float, str]:
    """Median seconds of `fn` replayed from a CUDA graph (launch gaps and Python out of the
    number; L2 flushed clean between replays, see `timed_median`), and how it was timed. Falls
    back to timing the plain calls, with more warm-up, when `fn` cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, autotune and allocate outside the capture
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        seconds = timed_median(graph.replay)
        del graph
        return seconds, "graph"
    except Exception as err:  # e.g. a host synchronisation inside fn
        log.warning("graph capture failed (%s): timing plain calls", err)
        torch.cuda.synchronize()
        for _ in range(50):
            fn()
        return timed_median(fn, budget_s=0.2), "plain"
