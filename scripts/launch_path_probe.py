"""Device probe: the host time of each piece of a generated kernel's launch: Triton's runner
against calling its launcher directly (the stream known, no launch hooks), output allocation,
stream lookups, TMA descriptors, and an eager op for scale. Microseconds per call, the median
of 5 loops of 2000 calls (a tiny kernel, so the launch queue never fills). Not a test.

    python scripts/launch_path_probe.py
"""
import statistics
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _copy(x, y, n, PHASE: tl.constexpr):
    offs = tl.arange(0, 1024)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n) + PHASE, mask=offs < n)


def per_call_us(fn, calls=2000, loops=5) -> float:
    times = []
    for _ in range(loops):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main():
    dev = torch.device("cuda")
    x = torch.randn(1024, device=dev)
    y = torch.empty_like(x)
    _copy[(1,)](x, y, 1024, PHASE=0)
    compiled = _copy.warmup(x, y, 1024, grid=(1,), PHASE=0)
    compiled._init_handles()
    runner = compiled[(1, 1, 1)]
    stream = torch._C._cuda_getCurrentRawStream(0)
    run, fn, meta = compiled.run, compiled.function, compiled.packed_metadata
    launch = run.launch
    rows = {
        "JIT call _copy[(1,)](...)": lambda: _copy[(1,)](x, y, 1024, PHASE=0),
        "compiled runner(*args)": lambda: runner(x, y, 1024, 0),
        "runner(*args, stream=s)": lambda: runner(x, y, 1024, 0, stream=stream),
        "launcher run(grid, stream, fn, meta, None, None, None, *args)":
            lambda: run(1, 1, 1, stream, fn, meta, None, None, None, x, y, 1024, 0),
        "C launch(...) directly": lambda: launch(1, 1, 1, stream, fn, False, False, None, None, meta, None, None, None,
                                                 x, y, 1024, 0),
        "torch.empty(1024, device)": lambda: torch.empty(1024, device=dev),
        "torch.empty((64, 56, 56), dtype, device)": lambda: torch.empty((64, 56, 56), dtype=torch.bfloat16, device=dev),
        "torch.cuda.current_stream(dev).cuda_stream": lambda: torch.cuda.current_stream(dev).cuda_stream,
        "torch._C._cuda_getCurrentRawStream(0)": lambda: torch._C._cuda_getCurrentRawStream(0),
        "x.add_(1) (eager, for scale)": lambda: x.add_(1),
        "x.data_ptr() % 16": lambda: x.data_ptr() % 16,
        "x.stride()": lambda: x.stride(),
    }
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        from triton.experimental.gluon import language as gl

        layout = gl.NVMMASharedLayout.get_default_for([64, 64], gl.float32)
        m = torch.randn(1024, 1024, device=dev)
        rows["TensorDescriptor.from_tensor"] = lambda: TensorDescriptor.from_tensor(m, [64, 64], layout)
    except Exception as err:  # noqa: BLE001 - a probe
        print("no Gluon descriptor:", err)
    for label, f in rows.items():
        print(f"{per_call_us(f):8.2f} us  {label}")


if __name__ == "__main__":
    main()
