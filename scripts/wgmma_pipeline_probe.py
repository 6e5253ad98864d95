"""Device probe: the wgmma chain kernel's streamed tile, synchronous against pipelined (GEMM1 of
chunk c+1 during chunk c's activation, B and D on rings of their own). Checks both against a
float32 reference on odd shapes, both weight layouts, with and without bias, every activation,
and the streamed path forced on shapes whose weights would stay resident (several tiles per
program, one chunk per tile); then times them in alternating rounds (CUDA-graph replays, L2
evicted clean) beside eager and torch.compile. Not a test: prints a table.

    PYTHONPATH=. python3 scripts/wgmma_pipeline_probe.py [--quick]
"""
import sys

import torch
import torch.nn.functional as F

from stitchflow.targets.gpu import chain_wgmma as cw
from stitchflow.targets.gpu.chain_wgmma import WgmmaTiles
from stitchflow.targets.gpu.timing import graph_bench

ACT_REF = {"none": lambda v: v, "relu": F.relu, "gelu": F.gelu, "silu": F.silu,
           "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}


def run(a, b, d, act, tiles, bias=None, pipelined=True, resident=None):
    out = torch.empty((a.shape[0], d.shape[1]), dtype=a.dtype, device=a.device)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    grid = (max(1, min(-(-a.shape[0] // tiles.bm), sms * tiles.programs_per_sm)),)
    args, meta = cw.launch_args(a, b, d, out, bias, act, tiles)
    meta["PIPELINED"] = pipelined
    if resident is not None:
        meta["RESIDENT"] = resident
    cw.kernel_module().chain_wgmma_kernel[grid](*args, **meta)
    return out


def operands(M, K, N, L, dtype, linear, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    w1 = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(dtype)
    w2 = (torch.randn(L, N, device="cuda", generator=g) / N ** 0.5).to(dtype)
    b, d = (w1.t(), w2.t()) if linear else (w1.t().contiguous(), w2.t().contiguous())
    bias = (torch.randn(N, device="cuda", generator=g) * 0.1).to(dtype)
    return a, b, d, bias


def checks():
    cases = []
    tiles_s = WgmmaTiles(64, 64, 4, 2, 2, 2)
    for M in (16384, 1000, 64 * 264 * 3 + 17):
        for linear in (True, False):
            for act in ACT_REF:
                cases.append(((M, 128, 512, 128), torch.bfloat16, linear, act, act == "gelu", tiles_s, None))
    cases.append(((4099, 128, 512, 128), torch.float16, True, "gelu", True, tiles_s, None))
    cases.append(((4099, 128, 512, 128), torch.bfloat16, True, "gelu", False, WgmmaTiles(64, 64, 4, 2, 3, 1), None))
    cases.append(((4099, 128, 512, 128), torch.bfloat16, True, "gelu", True, WgmmaTiles(128, 64, 8, 2, 2, 1), None))
    # streamed forced where the weights would stay: several tiles a program; one chunk a tile (N = bn)
    cases.append(((65536 + 33, 64, 256, 64), torch.bfloat16, True, "gelu", True, WgmmaTiles(64, 128, 4, 2, 2, 2), False))
    cases.append(((20000, 64, 64, 64), torch.bfloat16, False, "relu", True, WgmmaTiles(64, 64, 4, 2, 2, 2), False))
    cases.append(((20000, 64, 256, 64), torch.bfloat16, True, "gelu", False, WgmmaTiles(64, 64, 4, 2, 3, 2), False))
    failures = 0
    for n, ((M, K, N, L), dtype, linear, act, with_bias, tiles, resident) in enumerate(cases):
        a, b, d, bias = operands(M, K, N, L, dtype, linear, seed=n)
        bias = bias if with_bias else None
        h = a.float() @ b.float() + (bias.float() if bias is not None else 0)
        want = ACT_REF[act](h).to(dtype).float() @ d.float()
        errs = []
        for pipelined in (False, True):
            for _ in range(3):  # repeated launches: a ring phase that is wrong tends to show on later calls
                out = run(a, b, d, act, tiles, bias, pipelined, resident)
            torch.cuda.synchronize()
            errs.append(((out.float() - want).abs().max() / want.abs().max()).item())
        ok = all(e < 2e-2 for e in errs)
        failures += not ok
        print(f"check {'ok  ' if ok else 'FAIL'} M={M} K={K} N={N} L={L} {str(dtype)[6:]} linear={linear} act={act} "
              f"bias={with_bias} {tiles} resident={resident}: sync {errs[0]:.1e} pipelined {errs[1]:.1e}", flush=True)
    print(f"checks: {len(cases) - failures}/{len(cases)} passed", flush=True)


def timings(rounds):
    shapes = [((16384, 128, 512, 128), [WgmmaTiles(64, 64, 4, 2, 2, 2), WgmmaTiles(64, 64, 4, 1, 2, 2),
                                        WgmmaTiles(128, 64, 8, 2, 2, 1), WgmmaTiles(128, 128, 8, 1, 2, 1)]),
              ((65536, 64, 256, 64), [WgmmaTiles(64, 128, 4, 2, 2, 2)]),
              ((8192, 256, 1024, 256), [WgmmaTiles(64, 64, 4, 2, 2, 1)]),
              ((32768, 128, 1024, 128), [WgmmaTiles(64, 64, 4, 2, 2, 2)])]
    for (M, K, N, L), variants in shapes:
        a, b, d, _ = operands(M, K, N, L, torch.bfloat16, True, seed=0)
        comp = torch.compile(lambda a, b, d: F.gelu(a @ b) @ d)
        runners = {"eager": lambda: F.gelu(a @ b) @ d, "torch.compile": lambda: comp(a, b, d)}
        for t in variants:
            resident = cw.is_resident(K, N, L, t)
            modes = [(True, None)] if resident else [(False, None), (True, None)]
            for pipelined, res in modes:
                label = f"{t} {'resident' if resident else ('pipelined' if pipelined else 'sync')}"
                runners[label] = (lambda t=t, p=pipelined, r=res: run(a, b, d, "gelu", t, None, p, r))
        times = {k: [] for k in runners}
        for _ in range(rounds):
            for k, fn in runners.items():
                try:
                    times[k].append(graph_bench(fn)[0])
                except Exception as err:  # noqa: BLE001 - a probe reports and goes on
                    print(f"  {k}: {type(err).__name__}: {str(err)[:200]}")
                    times[k].append(float("nan"))
        base = min(sorted(times["eager"])[rounds // 2], sorted(times["torch.compile"])[rounds // 2])
        print(f"\n{M}x{K}-{N}-{L} (µs, median of {rounds} rounds; x = best of eager/compile over it)")
        for k, v in times.items():
            med = sorted(v)[rounds // 2] * 1e6
            print(f"  {k:45s} {med:8.1f}  rounds {' '.join(f'{x * 1e6:.1f}' for x in v)}  x{base * 1e6 / med:.2f}",
                  flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    checks()
    timings(3 if "--quick" in sys.argv else 5)
