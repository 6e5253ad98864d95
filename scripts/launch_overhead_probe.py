"""Device probe: how much of a generated Gluon kernel's do_bench time is the host? For column_center and
column_standardize (65536x1024 fp32, the bench's config) and the hand-written kernel of column_wide_probe: the
do_bench median, the host's time per call without synchronising, and the kernel's own duration from the profiler
(CUPTI). Not a test.

    python scripts/launch_overhead_probe.py [--fast | --fast-small]
"""
import itertools
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from stitchflow.bench.stitching_patterns import PATTERNS
from stitchflow.targets.gpu.runtime import Launch

sys.path.insert(0, "scripts")
from column_wide_probe import generated_column  # noqa: E402 - a sibling script

R, C = 65536, 1024


def per_call_us(fn, calls: int, until_done: bool) -> float:
    """Wall time per call of `calls` calls in a loop: until the host has issued them (until_done=False: the host's
    own time, as long as the launch queue does not fill) or until the device has run them (what a user's loop
    sees, back to back with no flush between)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    if until_done:
        torch.cuda.synchronize()
    took = (time.perf_counter() - t) / calls
    torch.cuda.synchronize()
    return took * 1e6


def host_us(fn):
    return per_call_us(fn, 20, until_done=False)


def back_to_back_us(fn):
    return per_call_us(fn, 200, until_done=True)


def profiled(fn, calls: int, warmup: int = 1):
    """torch.profiler's record of `calls` calls of fn (CUDA activity), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def kernel_us(fn, calls=20):
    prof = profiled(fn, calls)
    times = sorted(e.device_time for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 50)
    return times[len(times) // 2] if times else float("nan"), len(times)


def fast_against_jit(shapes=(R, R // 8), rounds: int = 1):
    """The generated Gluon kernels launched through the compiled kernel (Launch's fast path) against Triton's JIT
    (STITCHFLOW_GLUON_JIT=1's path), at the bench's shape and an eighth of it; `rounds` times over in turn."""
    for name, rows, _ in itertools.product(("column_center", "column_standardize"), shapes, range(rounds)):
        k, spec, env = generated_column(name, rows)
        ref = PATTERNS[name].module()(*env.values())
        for path in ("fast", "jit"):
            launch = Launch(k.graph, spec, name)
            launch.fast_ok = path == "fast"
            for _ in range(3):  # the third call runs on the path under test
                launch(env)
            err = ((env[spec.outputs[0]] - ref).norm() / ref.norm()).item()
            took = launch.fast is not None
            print(f"{name} {rows}x{C} {path} (compiled-kernel runner in use: {took}): back to back "
                  f"{back_to_back_us(lambda: launch(env)):.1f} us per call, host {host_us(lambda: launch(env)):.1f} "
                  f"us, do_bench {do_bench(lambda: launch(env), warmup=5, rep=50, return_mode='median') * 1e3:.1f} "
                  f"us, relative error {err:.1e}", flush=True)


def report(label, fn):
    bench = do_bench(fn, warmup=5, rep=100, return_mode="median") * 1e3
    k, n = kernel_us(fn)
    print(f"{label}: do_bench {bench:.1f} us, host {host_us(fn):.1f} us per call, kernel (profiler, median of {n}) "
          f"{k:.1f} us", flush=True)


def main():
    if "--fast" in sys.argv:
        return fast_against_jit()
    if "--fast-small" in sys.argv:  # the eighth only, three rounds: host times vary between runs
        return fast_against_jit((R // 8,), rounds=3)
    for name in ("column_center", "column_standardize"):
        k, spec, env = generated_column(name)
        launch = Launch(k.graph, spec, name)
        report(f"generated {name}", lambda: launch(env))
    from column_wide_probe import BOX, HALF, column_wide
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    x = torch.randn(R, C, device="cuda")
    y = torch.empty_like(x)
    desc = TensorDescriptor.from_tensor(x, [BOX.value, HALF.value],
                                        gl.NVMMASharedLayout.get_default_for([BOX.value, HALF.value], gl.float32))
    cnt = torch.zeros(C // 32, dtype=torch.int32, device="cuda")
    part = torch.empty(64, C, device="cuda")
    calls = [0]

    def hand():
        column_wide[(128,)](desc, x, y, cnt, part, part, part, part, calls[0] * 64, 0, HALVES=1, ROWS=1024, SPLIT=64,
                            GROUPS=2, STD=False, ATOMIC=False, NOBAR=False, num_cols=C, num_rows=R, num_warps=8,
                            launch_cooperative_grid=True)
        calls[0] += 1
    report("hand center 32x1024", hand)


if __name__ == "__main__":
    main()
