"""Device profiles: the measured ceilings the gpu cost model divides by.

Defaults are the H200 numbers of spec/workloads.md (copy 4.2 TB/s counting read + write, bf16
GEMM 690 TFLOP/s); the fp32 rate (67 TFLOP/s) is the H200 datasheet's non-tensor-core figure,
and the launch cost (5 us) is what eager torch.sparse GCN on Cora loses to its CUDA-graph
replay (142 vs 71 us) spread over its ~14 launches. `measure()` times the ceilings on the
device at hand; `save`/`load` keep them as JSON for the planner.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class DeviceProfile:
    name: str = "NVIDIA H200 (spec/workloads.md)"
    copy_bandwidth: float = 4.2e12  # bytes/s, read + write counted
    gemm_rate: float = 690e12  # FLOP/s, bf16 tensor cores
    fp32_rate: float = 67e12  # FLOP/s, CUDA cores
    launch_s: float = 5e-6  # seconds per kernel launch

    def __str__(self) -> str:
        return (f"{self.name}: {self.copy_bandwidth / 1e12:.2f} TB/s, GEMM {self.gemm_rate / 1e12:.0f} TFLOP/s, "
                f"fp32 {self.fp32_rate / 1e12:.0f} TFLOP/s, launch {self.launch_s * 1e6:.1f} us")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(asdict(self), indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "DeviceProfile":
        data = json.loads(Path(path).read_text())
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


def _median_time(fn, repeats: int = 20) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def measure(device: str = "cuda") -> DeviceProfile:
    """Time the ceilings on this GPU: a 1 GiB device copy, an 8192^3 bf16 GEMM, a 4096^3 fp32
    GEMM without tensor cores, and empty-kernel launches."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("measuring a device profile needs a CUDA device")
    n = 1 << 28
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() * 4 / _median_time(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    gemm = 2 * 8192 ** 3 / _median_time(lambda: a @ a, 10)
    torch.backends.cuda.matmul.allow_tf32 = False
    f = torch.randn(4096, 4096, device=device)
    fp32 = 2 * 4096 ** 3 / _median_time(lambda: f @ f, 10)
    tiny = torch.zeros(1, device=device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2000):
        tiny.add_(1)
    torch.cuda.synchronize()
    launch = (time.perf_counter() - t0) / 2000
    return DeviceProfile(torch.cuda.get_device_name(), copy, gemm, fp32, launch)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m stitchflow.planner.profile", description="measure a device profile")
    p.add_argument("--out", default="device_profile.json")
    args = p.parse_args(argv)
    prof = measure()
    prof.save(args.out)
    print(prof)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
