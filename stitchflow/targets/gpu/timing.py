"""Device timing shared by the gpu target's autotuners and benches: CUDA-graph replays, each
after a clean L2 flush, median over repetitions."""

from __future__ import annotations

import logging
import statistics
import time

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


def timed_median(fn, budget_s: float = 0.1, cooldown_s: float = 0.0) -> float:
    """Median seconds of `fn` over repetitions, each after a clean L2 flush (as do_bench, whose
    timing loop this follows, but with `_clean_l2_flush`). cooldown_s: see `flushed_times`."""
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
    return statistics.median(flushed_times(fn, reps, cooldown_s))


HOLD_ATTEMPTS = 4
MAX_HOLD_S = 10.0
_HOLD_S = [200e-6]  # how long the GPU waits before the first call of a timing (see flushed_times)


def flushed_times(fn, reps: int, cooldown_s: float = 0.0) -> list[float]:
    """Seconds of calls of `fn` (CUDA events around each), each after a clean L2 flush: about `reps` of them,
    leaving out any whose events may take in the host's time to launch it.

    A call's time is clean when the GPU has not reached its start event by the time the host has queued
    the call: the GPU then runs the call without waiting for the host. Usually the GPU is behind (each
    flush reads 256 MB), but a cold start times its kernels while compile processes and threads load the
    host, and a launch may then take milliseconds (ResNet-18's tuner medians summed to 8.8 ms against a
    5.3 ms step; scripts/timing_contention_probe.py: a 58 µs kernel timed at 10-15 ms beside two Python
    threads). The GPU first sleeps a moment, so that the host gets ahead; until half the calls came out
    clean, more are timed with the GPU held for twice as long as the host took to queue the last ones.

    cooldown_s: the GPU idles this long before the timed calls. Benches comparing runners give every runner the
    same pause, because an H200 running GEMMs back to back reaches its 700 W cap and lowers its clock (1980 MHz
    to 1500-1700, scripts/bench_order_probe.py): without the pause a runner timed right after its own back-to-back
    warm-up is timed on a slower chip than one whose warm-up the host paced.
    """
    clean: list[float] = []
    for attempt in range(HOLD_ATTEMPTS):
        if cooldown_s:
            torch.cuda.synchronize()
            time.sleep(cooldown_s)
        torch.cuda._sleep(int(min(_HOLD_S[0], MAX_HOLD_S) * 2e9))  # cycles at up to 2 GHz: at least that long
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        waited = []
        queued_from = time.perf_counter()
        for start, end in zip(starts, ends):
            _clean_l2_flush()
            start.record()
            fn()
            waited.append(start.query())  # the GPU had reached the call's start: it may have waited for the host
            end.record()
        queued_s = time.perf_counter() - queued_from
        torch.cuda.synchronize()
        clean += [s.elapsed_time(e) * 1e-3 for s, e, w in zip(starts, ends, waited) if not w]
        if len(clean) >= max(1, reps // 2):
            _HOLD_S[0] = 200e-6
            return clean
        _HOLD_S[0] = 2 * queued_s * 2 ** attempt
    log.debug("timing: the host fell behind the GPU in every attempt; %d of %d calls clean", len(clean), reps)
    return clean or [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)]


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


def against_torch(fn, ours, inputs) -> dict[str, float]:
    """Median µs of eager `fn`, torch.compile(fn) and `ours` on the same inputs (graph_bench each; torch.compile's
    compilation outside the timing)."""
    compiled = torch.compile(fn)
    compiled(*inputs)
    return {label: graph_bench(lambda call=call: call(*inputs))[0] * 1e6
            for label, call in (("eager", fn), ("compile", compiled), ("ours", ours))}


def against_torch_cells(times: dict[str, float], error: float) -> str:
    """A markdown row's cells: the three times, ours against eager and against torch.compile, the error."""
    return (f"{times['eager']:.1f} | {times['compile']:.1f} | {times['ours']:.1f} | "
            f"{times['eager'] / times['ours']:.2f}x | {times['compile'] / times['ours']:.2f}x | {error:.1e} |")
