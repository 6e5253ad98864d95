"""Max pooling with indices, interpolation and cumsum on the gpu target against eager on CUDA
(NaNs and ties included): python scripts/pool_indices_device_check.py"""

import torch
import torch.nn.functional as F

import stitchflow


def main() -> int:
    torch.manual_seed(0)
    x = torch.randn(4, 8, 33, 31, device="cuda")
    x[0, 0, 2, 3] = float("nan")
    x[1, 1, :3, :3] = 1.0
    cases = {
        "max_pool2d k2": lambda x: F.max_pool2d(x, 2, return_indices=True),
        "max_pool2d k3 s2 p1": lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True),
        "max_pool2d dilated ceil": lambda x: F.max_pool2d(x, (3, 2), (2, 1), (1, 0), (1, 2), True, True),
        "bf16 max_pool2d k3 s1 p1": lambda x: F.max_pool2d(x.bfloat16(), 3, 1, 1, return_indices=True),
        # without the NaN: torch's bicubic also spreads one through taps of weight 0, ours does not
        "bilinear + add": lambda x: (F.interpolate(torch.where(x == x, x, 0.0), scale_factor=2, mode="bilinear") + 1,),
        "bicubic aligned": lambda x: (F.interpolate(torch.where(x == x, x, 0.0), size=(40, 20), mode="bicubic",
                                                    align_corners=True),),
        "cumsum": lambda x: (torch.where(x == x, x, 0.0).cumsum(-1), (x > 0).cumsum(2)),
    }
    failed = 0
    for name, fn in cases.items():
        got = stitchflow.compile(fn, (x,), target="gpu", fusion="auto")(x)
        want = fn(x)
        ok = all(torch.equal(a, b) if not a.is_floating_point() else
                 torch.allclose(a.float(), b.float(), rtol=2e-2 if a.dtype == torch.bfloat16 else 1e-4, atol=1e-4,
                                equal_nan=True) for a, b in zip(got, want))
        failed += not ok
        print(f"{name}: {'ok' if ok else 'WRONG'}")
    print(f"{len(cases) - failed}/{len(cases)} equal eager")
    return int(failed > 0)


if __name__ == "__main__":
    raise SystemExit(main())
