"""Device check: reductions the frontend lowered in session 15 (var, std, amin, norm, max/min over a
dim with their indices, argmax) and NaN-keeping maxima, through the gpu target on CUDA tensors,
against eager; large column reductions take the TMA-fed (Gluon) pieces. Not a test (the CPU tests
run the same kernels under the interpreter); prints one line per case and exits 1 on a mismatch.

    PYTHONPATH=. python3 scripts/reductions_device_check.py
"""
import sys

import torch

import stitchflow

CASES = {
    "column amax": lambda x: x / x.amax(0),
    "column max(dim)": lambda x: x.max(0),
    "row argmax": lambda x: x.argmax(-1),
    "column std": lambda x: (x - x.mean(0)) / x.std(0),
    "row var, amin": lambda x: x.var(-1, keepdim=True) + x.amin(-1, keepdim=True),
    "norm": lambda x: x / x.norm(dim=-1, keepdim=True),
    "relu, maximum": lambda x: torch.maximum(x, x[:, :1]).relu(),
}


def main() -> int:
    bad = 0
    for shape in ((65536, 1024), (333, 257)):
        for nan in (False, True):
            x = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
            if nan:
                x[5, 7] = x[100 % shape[0], 200 % shape[1]] = float("nan")
            for name, fn in CASES.items():
                prog = stitchflow.compile(fn, (x,), target="gpu", fusion="full", options={"cuda_graphs": False})
                out, ref = prog(x), fn(x)
                outs = out if isinstance(out, (tuple, list)) else (out,)
                refs = ref if isinstance(ref, (tuple, list)) else (ref,)
                ok = all(o.shape == r.shape and o.dtype == r.dtype and torch.allclose(
                    o.float(), r.float(), rtol=1e-4, atol=1e-5, equal_nan=True) for o, r in zip(outs, refs))
                bad += not ok
                print(f"{shape} nan={nan} {name}: {'ok' if ok else 'MISMATCH'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
