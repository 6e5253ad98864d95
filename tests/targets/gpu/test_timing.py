"""targets/gpu/timing, which the autotuners and every GPU bench time with: L2 is evicted by reading (do_bench's
zeroing flush left dirty lines whose write-back landed in the timed call), and every timed call follows a flush."""
import pytest
import torch

from stitchflow.targets.gpu import timing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_clean_flush_reads_its_buffer_without_writing_it():
    timing._clean_l2_flush()
    buffer = timing._FLUSH_BUFFERS[torch.cuda.current_device()]
    l2 = getattr(torch.cuda.get_device_properties(buffer.device), "L2_cache_size", 50 << 20)
    assert buffer.numel() * buffer.element_size() >= 4 * l2  # enough reads to evict every line
    buffer.fill_(1.5)
    timing._clean_l2_flush()
    torch.cuda.synchronize()
    assert bool((buffer == 1.5).all())


def test_every_timed_call_follows_a_flush(monkeypatch):
    calls, calls_at_flush = [], []
    monkeypatch.setattr(timing, "_clean_l2_flush", lambda: calls_at_flush.append(len(calls)))
    x = torch.zeros(1 << 16, device="cuda")
    seconds = timing.timed_median(lambda: calls.append(x.add_(1)), budget_s=1e-3)
    torch.cuda.synchronize()
    assert 0 < seconds < 1
    assert len(calls_at_flush) >= 20                   # at least 20 timed repetitions
    timed = [b - a for a, b in zip(calls_at_flush, calls_at_flush[1:])] + [len(calls) - calls_at_flush[-1]]
    assert timed == [1] * len(calls_at_flush)          # one call after each flush, none unflushed in between
    assert x[0].item() == len(calls)                   # every call ran on the device


def test_a_host_slow_to_launch_is_not_timed():
    """A cold start times kernels while compile processes load the host: a call whose launch comes late must not
    count the GPU's wait for it (here 2 ms of host time before each launch of a microsecond's kernel)."""
    import time

    x = torch.zeros(1 << 10, device="cuda")

    def late_launch():
        time.sleep(2e-3)
        x.add_(1)

    seconds = timing.timed_median(late_launch, budget_s=1e-3)
    assert seconds < 0.5e-3
    times = timing.flushed_times(late_launch, 20)
    assert len(times) >= 10 and max(times) < 0.5e-3


def test_a_cooldown_idles_the_gpu_before_the_timed_calls(monkeypatch):
    """Benches give every runner the same pause before its timed calls (an H200 at its power cap lowers its clock):
    the GPU has finished the warm-up when the pause starts, and no timed call is queued during it."""
    import time

    x = torch.zeros(1 << 10, device="cuda")
    events = []
    real_sleep = time.sleep
    monkeypatch.setattr(timing.time, "sleep", lambda s: (events.append(("sleep", s)), real_sleep(s)))
    times = timing.flushed_times(lambda: events.append(("call", x.add_(1))), 20, cooldown_s=0.05)
    assert events[0] == ("sleep", 0.05) and all(kind == "call" for kind, _ in events[1:21])
    assert len(times) >= 10
